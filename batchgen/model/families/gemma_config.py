"""Gemma 2 and Gemma 3 `config.json` -> ModelConfig (hf_config.py's other families).

What differs from Llama's keys: `hidden_activation`, the softmax scale from
`query_pre_attn_scalar`, the soft-caps, per-layer windows from `layer_types` (older configs: every
other layer for Gemma 2, `sliding_window_pattern` for Gemma 3), and Gemma 3's two RoPE bases.
transformers 5 saves Gemma 3's `rope_parameters` per layer type ({"sliding_attention": ...,
"full_attention": ...}); 4.x saved `rope_theta`, `rope_local_base_freq` and a `rope_scaling` of
the global layers. A missing key takes the default of transformers' config class, as
transformers would load it.
"""

from __future__ import annotations

from batchgen.errors import ModelLoadError
from batchgen.model.config import Family, ModelConfig, RopeScaling

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma2Config / Gemma3TextConfig defaults, for keys a config.json leaves out
_DEFAULTS = {
    Family.GEMMA2: dict(
        max_position_embeddings=8192, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
    ),
    Family.GEMMA3_TEXT: dict(
        max_position_embeddings=131072, attn_logit_softcapping=None, final_logit_softcapping=None
    ),
}


def layer_types(hf: dict, family: Family) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
    else:
        every = 2 if family == Family.GEMMA2 else hf.get("sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
    other = sorted(set(types) - {SLIDING, FULL})
    if other or len(types) != n:
        raise ModelLoadError(
            f"layer_types {types} must name sliding_attention or full_attention for each of "
            f"the {n} layers"
        )
    return types


def _gemma3_rope(hf: dict) -> tuple[float, RopeScaling, float]:
    """(global base, global scaling, local base) of a Gemma 3 config, either layout."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:  # 4.x: rope_theta, rope_local_base_freq, the global layers' rope_scaling
        full = {**(hf.get("rope_scaling") or {}), **params}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"local layers' rope_type {local['rope_type']!r} is not supported")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelLoadError(f"Gemma 3 rope_type {kind!r} is not supported (default, linear)")
    scaling = RopeScaling(kind, float(full.get("factor", 1.0)))
    theta = float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
    return theta, scaling, float(local.get("rope_theta", 10000.0))


def gemma_config(hf: dict, family: Family) -> ModelConfig:
    """The ModelConfig of a Gemma 2 or Gemma 3 text config.json (hf_config.config_from_hf's
    errors for a missing key or a bad value)."""
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention (EmbeddingGemma) is not a causal LM")
    defaults = _DEFAULTS[family]
    windows = tuple(
        hf.get("sliding_window", 4096) if t == SLIDING else None for t in layer_types(hf, family)
    )
    if family == Family.GEMMA3_TEXT:
        theta, scaling, local = _gemma3_rope(hf)
    else:  # one RoPE for every layer
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        if params.get("rope_type", params.get("type", "default")) != "default":
            raise ModelLoadError("Gemma 2 with a rope_type other than default")
        theta, scaling, local = (
            float(params.get("rope_theta", hf.get("rope_theta", 1e4))),
            RopeScaling(),
            None,
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ModelLoadError(f"Gemma activation {act!r} is not supported")
    n_heads, bias = hf["num_attention_heads"], bool(hf.get("attention_bias", False))
    attn_softcap = hf.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
    return ModelConfig(
        family=family,
        model_type=family.value,
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or 256,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get(
            "max_position_embeddings", defaults["max_position_embeddings"]
        ),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        activation="gelu_tanh" if act == "gelu_new" else "gelu_pytorch_tanh",
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=family == Family.GEMMA3_TEXT,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=windows[0] if None not in windows else None,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        # Gemma 3's attention passes no soft-cap, whatever its config says (modeling_gemma3.py)
        attn_softcap=float(attn_softcap) if attn_softcap and family == Family.GEMMA2 else None,
        final_softcap=_float(
            hf.get("final_logit_softcapping", defaults["final_logit_softcapping"])
        ),
        layer_windows=windows,
        local_rope_theta=local,
    )


def _float(x: float | None) -> float | None:
    return None if x is None else float(x)
