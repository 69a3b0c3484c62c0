"""Which checkpoints the transformers backend (model/hf/backend.py) refuses, and why, decided
from config.json and the modeling class before any weight loads: encoder-decoders and encoders
(BERT: not a causal LM), pre-quantized checkpoints other than those transformers' own
quantizers load right here (`quant_refusal`), classes that compute attention in their own code
(no `_supports_attention_backend`: the backend replaces the attention interface's function, so
it cannot put its paged cache under them), KV sharing, and layers other than softmax attention
(recurrent or linear-attention hybrids)."""

from __future__ import annotations

import importlib.util

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
DEQUANTIZED = frozenset({"mxfp4"})  # pre-quantized formats transformers dequantizes at load
# Pre-quantized formats whose checkpoints transformers' quantizer decompresses at load (the
# backend reports them as stored, decompressed: format.checkpoint_scheme), with the module
# that quantizer needs. Their tokens equal transformers' own generate and the native
# implementation's (tests/test_hf_quant_stored.py). GPTQ and AWQ need gptqmodel, not used here.
DECOMPRESSED = {"compressed-tensors": "compressed_tensors", "fp8": None}
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
# Decoder-only softmax-attention families whose transformers 5 classes compute attention in their
# own code (no `_supports_attention_backend`) and that have no native decoder here: refused by
# name. The other classes without the interface are hybrids, encoders or encoder-decoders.
OWN_ATTENTION = {
    "stablelm": "StableLM",
    "falcon": "Falcon",
    "bloom": "BLOOM",
    "mpt": "MPT",
    "gpt_neo": "GPT-Neo",
    "biogpt": "BioGPT",
    "xglm": "XGLM",
    "openai-gpt": "GPT-1",
    "gpt_neox_japanese": "GPT-NeoX-Japanese",
    "cpmant": "CPM-Ant",
}


def refusal(config, cls) -> str | None:
    """Why the backend cannot serve this model exactly; None if it can."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder; the backend runs decoder-only causal LMs"
    why = quant_refusal(config)
    if why is not None:
        return why
    interface = getattr(cls, "_supports_attention_backend", False)
    if not interface and config.model_type in OWN_ATTENTION:
        name = OWN_ATTENTION[config.model_type]
        others = ", ".join(v for k, v in OWN_ATTENTION.items() if k != config.model_type)
        return (
            f"{name} ({cls.__name__}) computes its attention in its own code, not through "
            "transformers' attention interface, so the backend cannot put batchgen's paged KV "
            f"cache under it, and batchgen has no native {name} decoder (excluded alike: "
            f"{others}; README, Models)"
        )
    if not interface:
        return (
            f"{cls.__name__}'s layers do not call transformers' attention interface (recurrent "
            "or linear-attention layers, or attention written into the model)"
        )
    text = config.get_text_config()
    if getattr(text, "num_kv_shared_layers", 0):
        return "some of its layers reuse another layer's keys and values (KV sharing)"
    other = sorted(set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYERS)
    if other:
        return (
            f"it has {', '.join(other)} layers; the backend's paged cache holds softmax "
            "attention's keys and values only (full or sliding-window layers)"
        )
    return None


def quant_refusal(config) -> str | None:
    """Why the backend does not load config's pre-quantized checkpoint; None if it does."""
    method = quant_method(config)
    if method is None or method in DEQUANTIZED:
        return None
    native = "--model-impl native loads it (docs/quantization.md)"
    if method not in DECOMPRESSED:
        return (
            f"its checkpoint is pre-quantized ({method}); the backend loads float weights, "
            f"{' and '.join(sorted(DECOMPRESSED))} checkpoints (decompressed at load) and "
            f"dequantizes {', '.join(sorted(DEQUANTIZED))} at load; {native}"
        )
    module = DECOMPRESSED[method]
    if module is not None and importlib.util.find_spec(module) is None:
        return (
            f"its checkpoint is {method}, which transformers loads only with the {method} "
            f"package, not installed: pip install {method}, or use --model-impl native"
        )
    text = config.get_text_config()
    if any(getattr(text, n, None) for n in EXPERTS):
        return (
            f"its {method} checkpoint is a MoE model, whose stored experts the backend's load "
            f"is not checked on; {native}"
        )
    q = config.quantization_config
    groups = (q.get("config_groups") if isinstance(q, dict) else None) or {}
    for g in groups.values():
        w = (g.get("weights") if isinstance(g, dict) else None) or {}
        if w.get("num_bits") == 4 and w.get("symmetric") is False:
            return (
                f"its {method} W4A16 weights have zero points, which transformers mis-sizes "
                f"when it loads them (it re-initializes them); {native}"
            )
    return None


def quant_method(config) -> str | None:
    """The pre-quantized checkpoint's quant_method (None: float weights)."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method))


def encoder_refusal(config) -> str | None:
    """Why config is not a causal LM, where it is an encoder (BERT, RoBERTa, ...): such a
    family's causal-LM class exists, but runs its bidirectional encoder as a decoder only when
    config.json says `is_decoder`, and the checkpoint was not trained for that."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        config, "is_decoder", False
    ):
        return (
            f"model_type {config.model_type!r} is not a causal LM: an encoder (masked LM) "
            "checkpoint, which cannot generate text; pass --model a decoder-only causal LM "
            "(GPT-2, Llama, Qwen, Mistral, Gemma, Phi-3, ...)"
        )
    return None
