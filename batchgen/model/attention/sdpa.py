"""Scaled dot-product attention with what torch's SDPA lacks: logit soft-capping (Gemma 2)
and attention sinks (gpt-oss). The transformers backend (model/hf/backend.py) runs models
that use them; the native families never do, and keep torch's fused SDPA.

`AttnParams` is a layer's attention beyond q, k, v and the mask: its softmax scale (None:
1/sqrt(head_dim)), soft-cap and sinks. Without a soft-cap or sinks, attention is torch's SDPA
with the scale; with either, the scores are written out (as transformers' eager attention
does): scale, cap as cap * tanh(s / cap), mask, then a sink adds one logit per query head to
the softmax's denominator and nothing to its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttnParams:
    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H,) one logit per query head

    @property
    def fused(self) -> bool:
        """Whether torch's SDPA computes it (no soft-cap, no sinks)."""
        return self.softcap is None and self.sinks is None


DEFAULT = AttnParams()


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    params: AttnParams = DEFAULT,
    causal: bool = False,
    grouped: bool = False,
) -> torch.Tensor:
    """q (B, H, L, D), k, v (B, Hkv, S, D), mask broadcastable to (B, H, L, S) (bool, True:
    attend) -> (B, H, L, Dv). grouped: q is (B, Hkv, G, D), a decode's G query heads of each
    kv head on the query axis (one position each). causal (no mask): query i sees keys up
    to S - L + i."""
    if params.fused:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=params.scale, enable_gqa=not grouped
        )
    b, hkv, s = k.shape[:3]
    if grouped:
        qg, lq = q[:, :, :, None], 1  # (B, Hkv, G, 1, D)
    else:
        lq = q.shape[2]
        qg = q.view(b, hkv, q.shape[1] // hkv, lq, q.shape[3])  # (B, Hkv, G, L, D)
    scale = params.scale if params.scale is not None else q.shape[-1] ** -0.5
    scores = (qg.float() @ k[:, :, None].float().transpose(-1, -2)) * scale  # (B, Hkv, G, L, S)
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    if causal:
        mask = torch.ones(lq, s, dtype=torch.bool, device=q.device).tril(s - lq)
    if mask is not None:
        scores = scores.masked_fill(~(mask[:, :, None] if mask.dim() == 4 else mask), -torch.inf)
    if params.sinks is not None:  # one more logit per query head, in the denominator only
        sink = params.sinks.float().view(1, hkv, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    y = (probs @ v[:, :, None].float()).to(q.dtype)  # (B, Hkv, G, L, Dv)
    return y[:, :, :, 0] if grouped else y.view(b, -1, lq, y.shape[-1])
