"""Decode attention over gathered blocks (the gather path, the CPU's): each row's blocks
copied out of the pool, then one SDPA call with a length mask.

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
) -> torch.Tensor:
    """q (B, H, D), one query per sequence, over its blocks (B, n) of the pools -> (B, H, Dv)."""
    b, h, d = q.shape
    k, v = gather_blocks(k_pool, v_pool, blocks, block_size)  # (B, S, Hkv, D)
    hkv = k.shape[2]
    # Grouped-query attention folded into the query axis: the g query heads of a kv head
    # are its g "query positions", (B, Hkv, g, D), so K/V need no copy per query head.
    y = sdpa(
        q.view(b, hkv, h // hkv, d),
        k.transpose(1, 2),  # (B, Hkv, S, D)
        v.transpose(1, 2),
        mask,
        params,
        grouped=True,
    )
    return y.reshape(b, h, -1)
