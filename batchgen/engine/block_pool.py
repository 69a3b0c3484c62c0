"""The KV block pool's bookkeeping: plain Python, no torch.

The cache is `num_blocks` blocks of `block_size` token slots per layer; this class only
decides which block ids a sequence holds. Block 0 is never handed out: padding tokens of a
compiled step write there, so it is scratch.

Automatic prefix caching: a full block is keyed by a chained hash of its tokens (the hash
of the block before it and its own token ids), so a key names a whole token prefix. Once a
block's keys/values are computed, `cache` records it under that key; a later sequence whose
prompt starts with the same tokens takes the block (`take_cached`) instead of recomputing
it. Blocks are reference counted; a block whose count drops to 0 goes to the free list but
keeps its key until it is reused, so it can still be hit. The free list is LRU: new blocks
are taken from its front, freed blocks go to its back.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

NULL_BLOCK = 0  # scratch: padding writes land here; never part of a block table


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Key of a full block: xxh3-64 over the parent block's key and the block's tokens."""
    data = (parent or 0).to_bytes(8, "little") + array("q", tokens).tobytes()
    return xxhash.xxh3_64_intdigest(data)


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Keys of every full block of `tokens`, in order."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(
            block_hash(hashes[-1] if hashes else None, tokens[start : start + block_size])
        )
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a KV pool needs at least 2 blocks (one is scratch), got {num_blocks}"
            )
        self.num_blocks, self.block_size, self.prefix_caching = (
            num_blocks,
            block_size,
            prefix_caching,
        )
        self.ref_count = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks  # the prefix key a block is cached under
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}  # prefix key -> block id
        self.hits = self.queries = 0  # blocks found / looked up in the prefix cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, least recently freed first; a cached block taken here loses its key."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        ids = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            if self.key[b] is not None:
                del self.cached[self.key[b]]
                self.key[b] = None
            self.ref_count[b] = 1
            ids.append(b)
        return ids

    def release(self, ids: Sequence[int]) -> None:
        """Drop one reference to each block. Freed in reverse, so a sequence's last (least
        shared) blocks are reused before its first ones."""
        for b in reversed(ids):
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            if self.ref_count[b] == 0:
                self.free[b] = None

    def is_cached(self, key: int) -> bool:
        return self.prefix_caching and key in self.cached

    def take_cached(self, keys: Sequence[int]) -> list[int]:
        """The blocks caching the longest run of `keys` from the start, each with one more
        reference (a block on the free list comes off it)."""
        if not self.prefix_caching:
            return []
        ids = []
        for k in keys:
            b = self.cached.get(k)
            if b is None:
                break
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
            ids.append(b)
        return ids

    def record_lookup(self, queried: int, found: int) -> None:
        """Count one admission's prefix-cache lookup (retries of a failed admission are not
        counted: they would inflate the hit rate)."""
        self.queries += queried
        self.hits += found

    def cache(self, block: int, key: int) -> None:
        """Block's keys/values are computed and it is full: make it findable under key. If
        another block already caches that prefix, this one stays private."""
        if self.prefix_caching and self.key[block] is None and key not in self.cached:
            self.cached[key] = block
            self.key[block] = key
