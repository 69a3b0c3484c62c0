"""Tiny random checkpoints of families batchgen runs through the transformers backend (hidden
64, 2 layers, vocab 512), each with the feature that makes it differ from Llama set small
enough to matter: Gemma 2's attention soft-cap, Gemma 3's per-layer sliding window and
query_pre_attn_scalar scale, gpt-oss's sinks and windows, Granite's multipliers. Queries and
keys are sharpened (tiny_models.sharpen_attention) so a missing feature changes the tokens.

    python tests/tiny_hf_models.py gemma3_text /tmp/tiny-gemma3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from tiny_models import SHARPEN, llama_sizes, sharpen_attention, tiny_tokenizer

COMMON = llama_sizes(64)
SLIDING_FULL = ["sliding_attention", "full_attention"]
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "llama": {},
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": MOE,
    "gemma2": dict(
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=1.0,  # scores reach ~2.3 (5.0 changed them little)
        final_logit_softcapping=0.5,  # logits reach ~0.75
        query_pre_attn_scalar=64,
    ),
    "gemma3_text": dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=64, layer_types=SLIDING_FULL
    ),
    # global (full) layers with their own head size and KV heads: a pool per layer's shape
    "gemma4_text": dict(
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=8,
        layer_types=SLIDING_FULL,
        num_kv_shared_layers=0,
    ),
    "phi3": {},
    "olmo2": {},
    "granite": dict(attention_multiplier=0.5, logits_scaling=2.0, residual_multiplier=0.5),
    # its head is tied to the embedding by default, which at this size repeats the last token
    "smollm3": dict(no_rope_layer_interval=2, tie_word_embeddings=False),
    # its YaRN RoPE scales 4096 positions by 32
    "gpt_oss": dict(
        head_dim=16,
        sliding_window=8,
        layer_types=SLIDING_FULL,
        max_position_embeddings=131072,
        **MOE,
    ),
    # Llama 4 text: a chunked-attention layer (chunks of 8, shorter than the prompts) with RoPE,
    # a NoPE full-attention layer with its temperature tuning, MoE with a shared expert
    "llama4_text": dict(
        head_dim=16,
        attention_chunk_size=8,
        no_rope_layers=[1, 0],
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=64,
        intermediate_size_mlp=128,
    ),
    # MLA: keys of 16 + 8, values of 16 (one pool of 24); as many KV heads as heads
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
}
# Multimodal wrappers whose language model runs text jobs alone
# (batchgen/model/checkpoint/multimodal.py), each with a tiny vision tower (1 layer, 28-pixel images
# of 14-pixel patches) that is saved and never loaded. Mistral 3's head is its own (Mistral Small
# 3.1's is), Gemma 3's tied.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
WRAPPERS = {
    "gemma3": dict(
        text_config={**COMMON, **FAMILIES["gemma3_text"]},
        vision_config=VISION,
        mm_tokens_per_image=4,
        image_token_index=500,
        boi_token_index=498,
        eoi_token_index=499,
    ),
    "mistral3": dict(
        text_config=dict(model_type="mistral", **COMMON),
        vision_config=dict(model_type="pixtral", head_dim=16, **VISION),
        image_token_index=500,
        tie_word_embeddings=False,
    ),
}
# Refused by the backend: their configs build, their layers are not all softmax attention.
HYBRIDS = {
    "qwen3_next": dict(head_dim=16, layer_types=["linear_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
}


def save_tiny_hf_model(model_type: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """A checkpoint directory with weights and tokenizer; a hybrid's config.json only (it is
    refused before anything else is read). overrides: config values over the family's."""
    path = Path(path)
    torch.manual_seed(seed)
    if model_type in WRAPPERS:
        cfg = transformers.AutoConfig.for_model(model_type, **WRAPPERS[model_type])
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
        sharpen_attention(model, SHARPEN)
        _gemma_norms(model, model_type)
        model.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        return path
    extra = FAMILIES.get(model_type, HYBRIDS.get(model_type, {}))
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    if model_type in HYBRIDS:
        cfg.save_pretrained(path)
        return path
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):  # initialised at 0: make each head's differ
                p.normal_(0.0, 2.0)
            if ".q_b_proj." in name or ".kv_b_proj." in name:  # MLA's queries and keys
                p *= SHARPEN
    sharpen_attention(model, SHARPEN)
    _gemma_norms(model, model_type)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# Gemma's RMSNorms scale by (1 + w), w initialised at 0: sharpening w leaves it 0, and a norm
# taken as w, 1 or (1 + w) could not be told apart. Random w, and q/k norms of SHARPEN * (1 + w).
GEMMA_NORMS = ("gemma2", "gemma3_text", "gemma3")


@torch.no_grad()
def _gemma_norms(model: torch.nn.Module, model_type: str) -> None:
    if model_type not in GEMMA_NORMS:
        return
    for name, p in model.named_parameters():
        if "vision" in name or not name.endswith("norm.weight"):
            continue
        p.normal_(0.0, 0.3)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.copy_(SHARPEN * (1 + p) - 1)


def quantize_experts_mxfp4(path: Path, seed: int = 0) -> Path:
    """A saved gpt-oss checkpoint's experts rewritten as gpt-oss's MXFP4 (with its
    quantization_config): each (E, in, out) weight becomes random 4-bit values, blocks of 32
    along `in` packed two a byte (E, out, in / 32, 16), and a power-of-two scale per block
    (E8M0 bytes, 2^-7..2^-4 here) (E, out, in / 32). Loaded, they dequantize to weights that
    differ from the float ones, so only a dequantizing load reproduces transformers'."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors.pop(name).shape
        blocks = (experts, n_out, n_in // 32)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (*blocks, 16), generator=g).byte()
        tensors[f"{name}_scales"] = torch.randint(120, 124, blocks, generator=g).byte()
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    return Path(path)


if __name__ == "__main__":
    print(save_tiny_hf_model(sys.argv[1], sys.argv[2]))
