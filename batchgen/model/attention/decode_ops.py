"""Decode attention over gathered blocks (the gather path, the CPU's): each row's blocks
copied out of the pool, then one SDPA call with a length mask. On the CPU the rows go a few at
a time through the layer's gather buffer (kv_cache.py: a fresh copy's page faults cost more
than the copy, and a few rows' copy is still in the cache when SDPA reads it back).

Both the eager and the compiled forward run it from inside the attention op
(model/attention/op.py), at the step's exact rows and table width: the compiled graph never
sees either, so it needs no bucket of widths.
"""

from __future__ import annotations

import torch

from batchgen.model.attention.kv_cache import gather_blocks
from batchgen.model.attention.sdpa import DEFAULT, AttnParams, sdpa
from batchgen.model.attention.windows import window_ok


def decode_mask(lens: torch.Tensor, s: int, window: int | None) -> torch.Tensor:
    """(B,) context lengths over s gathered key slots -> (B, 1, 1, s) SDPA mask."""
    k_pos = torch.arange(s, device=lens.device)[None, :]  # (1, S)
    q_pos = (lens - 1)[:, None]  # (B, 1)
    return ((k_pos <= q_pos) & window_ok(q_pos, k_pos, window))[:, None, None, :]


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_size: int,
    blocks: torch.Tensor,
    mask: torch.Tensor,
    params: AttnParams = DEFAULT,
    buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, D), one query per sequence, over its blocks (B, n) of the pools -> (B, H, Dv).
    buffer: the layer's gather buffer (PagedKVCache.gather_buffer): rows gathered into it as
    many at a time as fit (a row too long for it: all rows at once, into new tensors)."""
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    row = 2 * blocks.shape[1] * block_size * hkv * d  # a row's K and V, in elements
    step = b if buffer is None else buffer.numel() // row or b
    # Grouped-query attention folded into the query axis: the g query heads of a kv head
    # are its g "query positions", (B, Hkv, g, D), so K/V need no copy per query head.
    qf = q.view(b, hkv, h // hkv, d)
    parts = []
    for i in range(0, b, step):
        rows = slice(i, i + step)
        k, v = gather_blocks(k_pool, v_pool, blocks[rows], block_size, buffer)  # (b, S, Hkv, D)
        # (b, Hkv, S, D) views of the copy
        parts.append(
            sdpa(qf[rows], k.transpose(1, 2), v.transpose(1, 2), mask[rows], params, grouped=True)
        )
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(b, h, -1)
