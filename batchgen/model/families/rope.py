"""Rotary position embeddings, computed the way Hugging Face does (rotate-half layout)."""

from __future__ import annotations

import math

import torch

from batchgen.model.config import RopeScaling
from batchgen.model.families.longrope import longrope_tables


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Same expression as transformers' rope init, so float32 tables agree bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        return inv_freq
    # Llama 3.1+: long wavelengths are divided by `factor`, short ones kept, and the band
    # between them interpolated smoothly.
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    max_positions: int, head_dim: int, theta: float, scaling: RopeScaling, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_positions, head_dim), float32; head_dim: the rotated
    features (ModelConfig.rotary_dim). longrope: (2 * max_positions, head_dim), longrope.py."""
    if scaling.kind == "longrope":
        return longrope_tables(max_positions, head_dim, theta, scaling, device)
    inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)
    t = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., H, D); cos, sin: (..., R) already gathered at each token's position. R < D
    (a partial rotary factor, Phi-4-mini's): the first R features rotate, the rest pass."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    r = cos.shape[-1]
    if r < x.shape[-1]:
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
    return x * cos + _rotate_half(x) * sin
