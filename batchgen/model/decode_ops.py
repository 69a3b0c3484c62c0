"""A compiled decode step's attention: two custom ops, opaque to inductor.

Why: the decoder forward is compiled once with a symbolic batch (engine/compiled_step.py).
Lowered inside that graph, FlexAttention cannot take its decoding kernel (which needs a static
batch) and falls back to its main template, whose key tile must divide the cache block (it does
not at block 16 on sm90) and which pads the few queries per KV head to its tile, with no split
over the keys. So attention is an op of its own, as vLLM's `splitting_ops` are: the graph
calls it like a kernel, and inside it each device runs its best kernel at the sizes it needs:

- `batchgen::decode_gather`: gather each row's blocks, then SDPA (the CPU's path);
- `batchgen::decode_flex`: FlexAttention over the pool in place, compiled on its own at the
  static power-of-two row count of its mask (the CUDA decoding kernel, split-KV).

Each op writes the step's keys/values at their slots first (in place: the pools are mutated
arguments), then attends; the graph never sees the pool's size or the tables' width, so one
graph serves every pool and every context. Eager steps call the same math directly.
"""

from __future__ import annotations

import torch

from batchgen.model.kv_cache import gather_blocks, write_slots
from batchgen.model.paged_flex import PagedMask, flex_decode_attention
from batchgen.model.sdpa import DEFAULT, AttnParams, sdpa
from batchgen.model.windows import window_ok


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


@torch.library.custom_op("batchgen::decode_gather", mutates_args=("k_pool", "v_pool"))
def decode_gather(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, D), k, v (B, Hkv, D) of B decoding rows; slots (B,), tables (B, n), lens
    (B,) -> (B, H, D). scale, softcap, sinks: a layer's (sdpa.AttnParams; the transformers
    backend's)."""
    write_slots(k_pool, v_pool, slots, k, v)
    mask = decode_mask(lens, tables.shape[1] * block_size, window)
    params = AttnParams(scale, softcap, sinks)
    # contiguous, as the fake says (the written-out math's matmul may return other strides)
    return decode_attention(q, k_pool, v_pool, block_size, tables, mask, params).contiguous()


@torch.library.custom_op("batchgen::decode_flex", mutates_args=("k_pool", "v_pool"))
def decode_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    num: torch.Tensor,
    indices: torch.Tensor,
    logical: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As decode_gather, the rows read in place through a PagedMask's tensors (R >= B rows,
    a power of two: q is padded to R here and cut back)."""
    write_slots(k_pool, v_pool, slots, k, v)
    b, r = q.shape[0], lens.shape[0]
    qr = torch.cat([q, q.new_zeros(r - b, *q.shape[1:])]) if r > b else q
    m = PagedMask(num, indices, logical, tables, lens)
    params = AttnParams(scale, softcap, sinks)
    out = flex_decode_attention(qr, k_pool, v_pool, m, window, block_size, True, params)
    return out[:b].contiguous()


@decode_gather.register_fake
def _(q, k, v, k_pool, v_pool, slots, tables, lens, block_size, window, *params):
    return q.new_empty(q.shape)  # contiguous, as the op's result, whatever q's strides


@decode_flex.register_fake
def _(q, k, v, k_pool, v_pool, slots, num, indices, logical, tables, lens, block_size, window, *p):
    return q.new_empty(q.shape)  # contiguous, as the op's result
