"""Phi-3's config.json keys (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: model_type "phi3"): its RoPE
scaling, longrope (model/families/longrope.py), and its partial rotary factor. Read as transformers
5's Phi3Config reads them: the top-level original_max_position_embeddings over the one in the RoPE
parameters, the RoPE parameters' partial_rotary_factor over the top-level one, "su" and "yarn"
as longrope."""

from __future__ import annotations

import math

from batchgen.model.config import RopeScaling

# Phi3Config's default for a config.json without the key
ORIGINAL_CONTEXT = 4096


def rope_params(hf: dict) -> dict:
    """The RoPE parameters: transformers 5's rope_parameters over 4.x's rope_scaling."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def longrope_scaling(hf: dict) -> RopeScaling:
    """A longrope config's RopeScaling: the factor s defaults to max_position_embeddings /
    original, the attention factor to sqrt(1 + ln(s) / ln(original)) (1 where s <= 1), as
    transformers' _compute_longrope_parameters sets them."""
    params = rope_params(hf)
    original = int(
        hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or ORIGINAL_CONTEXT
    )
    factor = params.get("factor")
    if factor is None:
        factor = hf.get("max_position_embeddings", 4096) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        kind="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention),
    )


def partial_rotary_factor(hf: dict) -> float:
    return float(rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
