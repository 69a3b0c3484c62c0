"""Attention over the paged KV cache for one engine step.

A step is a flat run of T tokens from several sequences: first `num_decodes` single tokens
(one per decoding sequence), then each prefilling sequence's chunk of prompt tokens, packed
with no padding. Every token's key/value is written at its own cache slot first; then

- decodes attend in a few groups of similar context length: each group's blocks are
  gathered into a (B, n_blocks * block_size) batch (n_blocks: the group's longest table,
  padded with the scratch block) and one SDPA call runs with a length mask. Grouping keeps
  the padded blocks few (the gather is the costly part on the CPU: it copies the KV once
  more), while each group stays one batched call;
- each prefill chunk attends on its own: to its own fresh keys/values with a causal SDPA
  when nothing of the sequence is cached yet, else to its blocks (cached prefix or earlier
  chunks + this chunk) with an offset causal mask.

Sliding-window models (Mistral) add `query - key < window` to every mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.model.kv_cache import PagedKVCache


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens within a step."""

    q_start: int  # index of the chunk's first token in the step's flat tokens
    q_len: int
    ctx_start: int  # the sequence's tokens already cached: the chunk sits at positions ctx_start..
    blocks: (
        torch.Tensor | None
    )  # (n,) blocks of positions [0, ctx_start + q_len); None if ctx_start == 0


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences q_start.. q_start + B - 1 of a step, attended in one call."""

    q_start: int
    blocks: torch.Tensor  # (B, n) block tables, padded with the scratch block
    lens: torch.Tensor  # (B,) context lengths, this token included


@dataclass(slots=True)
class StepAttention:
    """What the attention layers need to know about a step, shared by all layers. The
    decodes are tokens 0..num_decodes - 1, covered by the groups in order."""

    slots: torch.Tensor  # (T,) flat cache slot of each token's key/value
    num_decodes: int
    decodes: tuple[DecodeGroup, ...] = ()
    prefills: tuple[PrefillSpan, ...] = ()


def _window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    return (q_pos - k_pos) < window if window is not None else torch.ones_like(k_pos, dtype=torch.bool)  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    blocks: torch.Tensor,
    lens: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """q (B, H, D), one query per sequence at position lens - 1 -> (B, H, D)."""
    b, h, d = q.shape
    k, v = cache.gather(blocks)  # (B, S, Hkv, D)
    hkv = k.shape[2]
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]  # (1, S)
    q_pos = (lens - 1)[:, None]  # (B, 1)
    mask = (k_pos <= q_pos) & _window_ok(q_pos, k_pos, window)  # (B, S)
    # Grouped-query attention folded into the query axis: the g query heads of a kv head
    # are its g "query positions", (B, Hkv, g, D), so K/V need no copy per query head.
    y = F.scaled_dot_product_attention(
        q.view(b, hkv, h // hkv, d),
        k.transpose(1, 2),  # (B, Hkv, S, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
    )
    return y.reshape(b, h, d)


def _heads_first(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(S, Hkv, D) -> (1, H, S, D), each kv head repeated for its query heads."""
    x = x.transpose(0, 1)
    return x.repeat_interleave(n_heads // x.shape[0], dim=0)[None]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    span: PrefillSpan,
    window: int | None,
) -> torch.Tensor:
    """q (n, H, D) and the chunk's own k, v (n, Hkv, D) -> (n, H, D)."""
    n, h, _ = q.shape
    qh = q.transpose(0, 1)[None]  # (1, H, n, D)
    if span.blocks is not None:  # earlier tokens are cached: read them (and the chunk) back
        k, v = cache.gather(span.blocks)
        k, v = k[: span.ctx_start + n], v[: span.ctx_start + n]
    kh, vh = _heads_first(k, h), _heads_first(v, h)
    if span.blocks is None and window is None:
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        q_pos = span.ctx_start + torch.arange(n, device=q.device)[:, None]  # (n, 1)
        k_pos = torch.arange(k.shape[0], device=q.device)[None, :]  # (1, S)
        mask = (k_pos <= q_pos) & _window_ok(q_pos, k_pos, window)
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return y[0].transpose(0, 1)


def step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    step: StepAttention,
    window: int | None,
) -> torch.Tensor:
    """q (T, H, D), k, v (T, Hkv, D) of a whole step -> (T, H, D)."""
    cache.write(step.slots, k, v)
    parts = []
    for g in step.decodes:
        qg = q[g.q_start : g.q_start + g.lens.shape[0]]
        parts.append(decode_attention(qg, cache, g.blocks, g.lens, window))
    for s in step.prefills:
        sl = slice(s.q_start, s.q_start + s.q_len)
        parts.append(prefill_attention(q[sl], k[sl], v[sl], cache, s, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
