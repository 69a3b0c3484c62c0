"""A static KV cache: fixed buffers updated in place at each row's own slots.

The storage is flat, (capacity_tokens, n_kv_heads, head_dim), and each batch shape
views it as (batch, row_stride, ...) with batch * row_stride <= capacity. So one
allocation serves a bucket of many short rows and a bucket of few long ones, and the
compiled graphs always see the same storage, which is what CUDA graphs need.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(
        self,
        capacity_tokens: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        shape = (capacity_tokens, n_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def capacity_tokens(self) -> int:
        return self.k.shape[0]

    def update(
        self,
        index: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        row_stride: int,
        kv_len: int,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, T, H, D) at flat positions index (B, T) = row * row_stride + slot;
        return the first kv_len slots of each of the B rows, (B, kv_len, H, D) each.
        rows (B,): the cache rows of the batch's rows; None: rows 0..B-1."""
        self.k.index_put_((index,), k)
        self.v.index_put_((index,), v)
        b, _, h, d = k.shape
        if rows is None:
            k_rows = self.k[: b * row_stride].view(b, row_stride, h, d)
            v_rows = self.v[: b * row_stride].view(b, row_stride, h, d)
            return k_rows[:, :kv_len], v_rows[:, :kv_len]
        n = self.capacity_tokens // row_stride  # a gather: prefill into some rows of a batch
        k_rows = self.k[: n * row_stride].view(n, row_stride, h, d)
        v_rows = self.v[: n * row_stride].view(n, row_stride, h, d)
        return k_rows[rows, :kv_len], v_rows[rows, :kv_len]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys/values at flat positions src (P,) to dst (B, P): a shared prefix
        into rows. A key carries its position's rotation, so it may sit at any slot."""
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]
