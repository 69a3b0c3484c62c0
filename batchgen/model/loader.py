"""Hugging Face checkpoint directories -> our Transformer.

With hf_config.py (config.json's keys per family), the one module that knows file formats:
the safetensors names of each family's weights, GPT-2's transposed Conv1D weights and the
fusing of q/k/v and gate/up into single matrices. The model is built on the meta device
and each tensor is cast and moved straight to its target, so a 16 GB checkpoint never
has a float32 copy in host memory.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.config import Family, ModelConfig
from batchgen.model.hf_config import config_from_hf, read_hf_config
from batchgen.model.memory import check_allocation
from batchgen.model.transformer import Transformer

# --- checkpoint names -------------------------------------------------------------------

_LLAMA_NAMES = {
    "self_attn.o_proj": "attn.wo",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.down_proj": "mlp.w_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
}
# Pieces concatenated (dim 0) into one of our fused matrices, in this order.
_LLAMA_FUSED = {
    "attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.w_in": ("mlp.gate_proj", "mlp.up_proj"),
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
}
_LLAMA_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _checkpoint_files(path: Path, allow_pickle: bool) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = sorted(path.glob("*.safetensors"))
    if single:
        return single
    pickles = sorted(path.glob("pytorch_model*.bin"))
    if pickles and allow_pickle:
        return pickles
    if pickles:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({pickles[0].name}); pickle files can run code "
            "when loaded. Convert to safetensors, or pass --allow-pickle if you trust the file."
        )
    raise ModelLoadError(f"no *.safetensors weights in {path}")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            if f.suffix == ".bin":
                yield from torch.load(f, map_location="cpu", weights_only=True, mmap=True).items()
                continue
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, sf.get_tensor(name)
        except pickle.UnpicklingError as e:
            # weights_only=True refuses objects other than tensors, which is what allows it;
            # torch's message goes on for a page, its first sentence says what happened.
            first = str(e).split(".")[0]
            raise ModelLoadError(
                f"cannot read weights file {f}: it holds more than tensors, or is not a PyTorch "
                f"checkpoint ({first}); convert a trusted copy to safetensors"
            ) from None
        except (OSError, RuntimeError, ValueError, EOFError, SafetensorError) as e:
            raise ModelLoadError(f"cannot read weights file {f}: {e}") from e


def _map_gpt2(name: str) -> tuple[str | None, bool]:
    """Our name for a GPT-2 tensor, and whether it is a Conv1D weight to transpose."""
    name = name.removeprefix("transformer.")
    if name in _GPT2_TOP:
        return _GPT2_TOP[name], False
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m or m.group(2) not in _GPT2_NAMES:
        return None, False  # attn.bias / masked_bias buffers of old checkpoints, lm_head (tied)
    i, mod, kind = m.groups()
    conv = kind == "weight" and mod.startswith(("attn.", "mlp."))
    return f"layers.{i}.{_GPT2_NAMES[mod]}.{kind}", conv


def _map_llama(name: str) -> tuple[str | None, tuple[str, int, int] | None]:
    """Our name for a Llama-style tensor, or (fused name, piece index, number of pieces)."""
    if name in _LLAMA_TOP:
        return _LLAMA_TOP[name], None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m:
        return None, None
    i, mod, kind = m.groups()
    if mod in _LLAMA_NAMES:
        return f"layers.{i}.{_LLAMA_NAMES[mod]}.{kind}", None
    for fused, parts in _LLAMA_FUSED.items():
        if mod in parts:
            return None, (f"layers.{i}.{fused}.{kind}", parts.index(mod), len(parts))
    return None, None


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint weight lives in our model: a parameter, or rows of a fused one."""

    name: str  # our parameter, e.g. "layers.0.attn.wqkv.weight"
    rows: slice | None = None  # the rows of a fused matrix this checkpoint tensor fills
    transposed: bool = False  # GPT-2's Conv1D stores (in, out); we store (out, in)


def weight_slot(cfg: ModelConfig, name: str) -> WeightSlot | None:
    """Our parameter (and rows) for a checkpoint tensor name; None for one we do not load."""
    if cfg.family == Family.GPT2:
        ours, conv = _map_gpt2(name)
        return WeightSlot(ours, transposed=conv) if ours is not None else None
    ours, piece = _map_llama(name)
    if ours is not None:
        return WeightSlot(ours)
    if piece is None:
        return None
    fused, idx, _ = piece
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sizes = (q, kv, kv) if ".attn.wqkv." in fused else (cfg.intermediate_size,) * 2
    start = sum(sizes[:idx])
    return WeightSlot(fused, slice(start, start + sizes[idx]))


def load_state_dict(
    cfg: ModelConfig, files: list[Path], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.to(device=device, dtype=dtype)

    for name, t in _iter_tensors(files):
        if cfg.family == Family.GPT2:
            ours, conv = _map_gpt2(name)
            if ours is not None:
                put(ours, t.t().contiguous() if conv else t)
            continue
        ours, piece = _map_llama(name)
        if ours is not None:
            put(ours, t)
        elif piece is not None:
            fused, idx, n_parts = piece
            parts = pending.setdefault(fused, {})
            parts[idx] = t.to(device=device, dtype=dtype)
            if len(parts) == n_parts:
                try:
                    out[fused] = torch.cat([parts[j] for j in sorted(parts)], dim=0)
                except RuntimeError as e:
                    raise ModelLoadError(
                        f"the pieces of {fused} do not fit together ({e}); the checkpoint "
                        "is damaged or mixes two models"
                    ) from None
                del pending[fused]
    if pending:
        raise ModelLoadError(f"checkpoint is missing pieces of {sorted(pending)}")
    return out


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    cfg: ModelConfig | None = None,
) -> Transformer:
    """The model in path; cfg: its config.json, already read (ModelSpec), else read here."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {path} does not exist. Pass --model a local directory saved with "
            "save_pretrained; batchgen never downloads from a hub."
        )
    cfg = cfg or config_from_hf(read_hf_config(path))
    device = torch.device(device)
    # The one table built from config.json alone, not read from the checkpoint: 10**9
    # positions would be a 16 GB allocation before any weight is read.
    check_allocation(
        cfg.rope_table_bytes,
        f"the RoPE tables for {cfg.max_position_embeddings} positions",
        f"max_position_embeddings in {path / 'config.json'}",
        device,
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = load_state_dict(cfg, _checkpoint_files(path, allow_pickle), dtype, device)
    if cfg.tie_embeddings or "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed.weight"]
    expected = set(model.state_dict())
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint in {path} does not match a {cfg.family.value} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    try:
        model.load_state_dict(sd, assign=True, strict=True)
    except RuntimeError as e:  # shapes that differ from config.json's
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        shown = "; ".join(lines[:2]) + ("; ..." if len(lines) > 2 else "")
        raise ModelLoadError(
            f"the checkpoint in {path} does not match its config.json ({shown}); the weights "
            "and config.json must come from the same model"
        ) from None
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)
