"""The paged KV cache of one layer: a pool of fixed-size blocks, written in place.

Storage is flat, (num_blocks * block_size, n_kv_heads, head_dim): token slot s of block b
is row b * block_size + s. Which blocks a sequence holds is the engine's business (its
block table, see engine/block_pool.py); this module only writes a step's keys/values at
their slots and gathers the blocks a sequence's attention reads. The buffers never move,
so compiled graphs (and CUDA graphs) always see the same storage.

On the CPU a gather copies into a small buffer of its own, reused by every call (issue 41):
glibc serves a block over 32 MiB with a fresh mmap even as the engine tunes it
(model/host_malloc.py), so a large gather's K and V were new memory every layer, every step,
and their page faults cost more than the copy. Through a 4 MiB buffer, a few rows at a time
(SDPA then reads the copy back from the cache), one layer's decode attention at 256 rows x
1024 tokens took 65 ms where the fresh gather took 229 ms, and a whole decode step of the
llama-55m shape ran 2.0-2.6x faster from 128 rows x 512 tokens up (docs/benchmarks.md).
The buffer grows with the thread count (`gather_bytes`): SDPA splits a gathered chunk's rows
and heads over the threads, so each thread wants its own share of rows in flight, not a
slice of a 2-thread chunk.
"""

from __future__ import annotations

import torch
from torch import nn

# A layer's gather buffer on the CPU holds this much per torch thread (2 threads at least:
# 4 MiB, what was measured on 2 cores), up to the cap: the decodes gather and attend that much
# at a time (within the threads' caches), a prefill chunk's context if it fits (else a fresh
# copy). The cap bounds the memory, one buffer a layer: 16 MiB x 32 layers is 512 MiB.
GATHER_BYTES_PER_THREAD = 2 << 20
GATHER_MAX_BYTES = 16 << 20


def gather_bytes(threads: int) -> int:
    """The gather buffer's size in bytes for a host running `threads` torch threads."""
    return min(max(threads, 2) * GATHER_BYTES_PER_THREAD, GATHER_MAX_BYTES)


class PagedKVCache(nn.Module):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self._buffer: torch.Tensor | None = None  # gather_buffer's, made on first use

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0] // self.block_size

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (T, Hkv, D) go to flat slots (T,)."""
        write_slots(self.k, self.v, slots, k, v)

    def gather_buffer(self) -> torch.Tensor | None:
        """gather_bytes(threads at first use) bytes of the pool's dtype that gathers may copy
        into, the same tensor every call; None off the CPU (the CUDA allocator keeps freed
        memory)."""
        if self.k.device.type != "cpu":
            return None
        if self._buffer is None:
            size = gather_bytes(torch.get_num_threads())
            self._buffer = self.k.new_empty(size // self.k.element_size())
        return self._buffer

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values of blocks (..., n), as (..., n * block_size, Hkv, D) each: views
        of the gather buffer where they fit in it (valid until the next gather), else new."""
        return gather_blocks(self.k, self.v, blocks, self.block_size, self.gather_buffer())


def write_slots(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k, v (T, Hkv, D) into the pools (slots, Hkv, D) at flat slots (T,), in place."""
    k_pool.index_copy_(0, slots, k)
    v_pool.index_copy_(0, slots, v)


def gather_blocks(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys/values of blocks (..., n) of the pools (slots, Hkv, D), as (..., n *
    block_size, Hkv, D) each: whole blocks copied by one index_select over a (num_blocks,
    block_size * Hkv * D) view, which on the CPU runs ~4x faster than over the 4-d view
    (measured). Into buffer (flat, the pools' dtype) where both fit in it, else new tensors."""
    h, d = k_pool.shape[1:]
    shape = (*blocks.shape[:-1], blocks.shape[-1] * block_size, h, d)
    flat = blocks.flatten()
    num_blocks = k_pool.shape[0] // block_size
    k_rows, v_rows = k_pool.view(num_blocks, -1), v_pool.view(num_blocks, -1)
    n = flat.numel() * k_rows.shape[1]
    if buffer is None or 2 * n > buffer.numel():
        return k_rows.index_select(0, flat).view(shape), v_rows.index_select(0, flat).view(shape)
    k, v = buffer[:n].view(flat.numel(), -1), buffer[n : 2 * n].view(flat.numel(), -1)
    torch.index_select(k_rows, 0, flat, out=k)
    torch.index_select(v_rows, 0, flat, out=v)
    return k.view(shape), v.view(shape)
