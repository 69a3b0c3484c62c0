"""Checkpoint tensor names -> our parameters: the names of each family's weights, GPT-2's
transposed Conv1D weights, the fusing of q/k/v and gate/up into single matrices, and with
tensor parallelism which slice of each tensor this rank takes (model/parallel/sharding.py); a MoE
layer's experts in model/checkpoint/moe_names.py. Used by
the loader (to read) and the LoRA merge (to find a layer's rows)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchgen.model.checkpoint.moe_names import moe_weight
from batchgen.model.checkpoint.multimodal import text_name
from batchgen.model.config import GEMMA_FAMILIES, Family, ModelConfig
from batchgen.model.parallel.sharding import (
    SINGLE,
    WHOLE,
    Copy,
    TPShard,
    gate_up_copies,
    qkv_copies,
    row_parallel_copies,
)

# --- checkpoint names -------------------------------------------------------------------

_LLAMA_NAMES = {
    "self_attn.o_proj": "attn.wo",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.down_proj": "mlp.w_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
}
# Gemma's four norms a layer: its post_attention_layernorm follows the attention (Llama's
# precedes the MLP), pre_feedforward_layernorm precedes the MLP.
_GEMMA_NAMES = {
    **_LLAMA_NAMES,
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}
# Pieces concatenated (dim 0) into one of our fused matrices, in this order.
_LLAMA_FUSED = {
    "attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.w_in": ("mlp.gate_proj", "mlp.up_proj"),
}
# Fused matrices a checkpoint stores whole (Phi-3), and which of ours each fills.
_WHOLE_FUSED = {
    "self_attn.qkv_proj": ("attn.wqkv", "qkv"),
    "mlp.gate_up_proj": ("mlp.w_in", "gate_up"),
}
_GPT2_NAMES = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn.wqkv",
    "attn.c_proj": "attn.wo",
    "ln_2": "mlp_norm",
    "mlp.c_fc": "mlp.w_in",
    "mlp.c_proj": "mlp.w_out",
}
_GPT2_TOP = {
    "wte.weight": "embed.weight",
    "wpe.weight": "pos_embed.weight",
    "ln_f.weight": "norm.weight",
    "ln_f.bias": "norm.bias",
    "lm_head.weight": "lm_head.weight",  # an untied head's own (a tied one is not saved)
}
_LLAMA_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    # a *ForSequenceClassification's head (families/classifier_head.py)
    "score.weight": "score.weight",
}
# A base model's tensors (LlamaModel, Qwen2Model saved alone, as embedding models ship): the
# causal LM's without its `model.` prefix, and no LM head.
_BASE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def _map_gpt2(name: str) -> tuple[str | None, bool]:
    """Our name for a GPT-2 tensor, and whether it is a Conv1D weight to transpose."""
    name = name.removeprefix("transformer.")
    if name in _GPT2_TOP:
        return _GPT2_TOP[name], False
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m or m.group(2) not in _GPT2_NAMES:
        return None, False  # attn.bias / masked_bias buffers of old checkpoints
    i, mod, kind = m.groups()
    conv = kind == "weight" and mod.startswith(("attn.", "mlp."))
    return f"layers.{i}.{_GPT2_NAMES[mod]}.{kind}", conv


def _map_llama(
    name: str, names: dict[str, str] = _LLAMA_NAMES
) -> tuple[str | None, tuple[str, int, int] | None]:
    """Our name for a Llama-style tensor, or (fused name, piece index, number of pieces)."""
    if name in _LLAMA_TOP:
        return _LLAMA_TOP[name], None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m:
        return None, None
    i, mod, kind = m.groups()
    if mod in names:
        return f"layers.{i}.{names[mod]}.{kind}", None
    for fused, parts in _LLAMA_FUSED.items():
        if mod in parts:
            return None, (f"layers.{i}.{fused}.{kind}", parts.index(mod), len(parts))
    return None, None


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint weight lives in our model: its parameter, and which slices of it
    go to which rows there (rows of a fused matrix; with tensor parallelism, this rank's
    part)."""

    name: str  # our parameter, e.g. "layers.0.attn.wqkv.weight"
    copies: tuple[Copy, ...] = WHOLE
    transposed: bool = False  # GPT-2's Conv1D stores (in, out); we store (out, in)

    @property
    def rows(self) -> slice | None:
        """The rows of a fused matrix the whole checkpoint tensor fills (one rank)."""
        return self.copies[0].dst if len(self.copies) == 1 else None


def weight_slot(cfg: ModelConfig, name: str, tp: TPShard = SINGLE) -> WeightSlot | None:
    """Our parameter and the copies into it for a checkpoint tensor name (rank tp's part);
    None for one we do not load (a multimodal wrapper's vision tower: multimodal.py)."""
    name = text_name(name)  # a wrapper's language model: the text family's own names
    if cfg.family == Family.GPT2:
        ours, conv = _map_gpt2(name)
        if ours is None:
            return None
        return WeightSlot(ours, _copies(cfg, tp, ours, "qkv" if ".wqkv." in ours else "in"), conv)
    if name.startswith(_BASE_PREFIXES):
        name = "model." + name
    if cfg.n_experts and (moe := moe_weight(cfg, name, tp)) is not None:
        return WeightSlot(*moe)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight", name)
    if m and cfg.family == Family.PHI3:  # its fused matrices, as ours: q|k|v, [gate; up] rows
        ours, which = _WHOLE_FUSED[m.group(2)]
        ours = f"layers.{m.group(1)}.{ours}.weight"
        return WeightSlot(ours, _copies(cfg, tp, ours, which))
    ours, piece = _map_llama(name, _GEMMA_NAMES if cfg.family in GEMMA_FAMILIES else _LLAMA_NAMES)
    if ours is not None:
        return WeightSlot(ours, _copies(cfg, tp, ours, ""))
    if piece is None:
        return None
    fused, idx, _ = piece
    which = ("q", "k", "v")[idx] if ".attn.wqkv." in fused else ("gate", "up")[idx]
    return WeightSlot(fused, _copies(cfg, tp, fused, which))


def _copies(cfg: ModelConfig, tp: TPShard, ours: str, piece: str) -> tuple[Copy, ...]:
    """How rank tp takes its part of our parameter `ours` (piece: which part of a fused one
    the checkpoint tensor is)."""
    kind = ours.rsplit(".", 2)[-2] if ours.startswith("layers.") else ours.split(".")[0]
    bias = ours.endswith(".bias")
    if kind == "wqkv":
        return qkv_copies(cfg, tp, piece)
    if kind == "w_in":
        return gate_up_copies(cfg, tp, piece)
    if tp.size == 1:
        return WHOLE
    if kind in ("embed", "lm_head"):
        return (Copy(0, tp.split(cfg.vocab_size)),)
    if kind == "wo":
        return row_parallel_copies(cfg.n_heads * cfg.head_dim, tp, bias)
    if kind == "w_out":
        return row_parallel_copies(cfg.intermediate_size, tp, bias)
    return WHOLE  # norms, q/k norms, GPT-2's position table: replicated
