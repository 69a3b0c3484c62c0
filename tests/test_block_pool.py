"""The KV block pool's bookkeeping: plain Python, no torch, no model.

Blocks handed out and given back, reference counts, the LRU free list, and the chained
prefix-cache keys: a cached block is found again only under the key of its whole prefix,
and only until it is reused for other tokens."""

import subprocess
import sys

import pytest

from batchgen.engine.block_pool import NULL_BLOCK, BlockPool, block_hash, chain_hashes


def _keys(n: int, salt: int = 0) -> list[int]:
    """Chained keys of n full 4-token blocks."""
    return chain_hashes([salt * 1000 + t for t in range(4 * n)], 4)


def _check(pool: BlockPool) -> None:
    """The pool's own invariants: free list == blocks with no reference; cache maps agree."""
    assert NULL_BLOCK not in pool.free and pool.ref_count[NULL_BLOCK] == 0
    assert set(pool.free) == {b for b in range(1, pool.num_blocks) if pool.ref_count[b] == 0}
    assert all(r >= 0 for r in pool.ref_count)
    assert {k: b for b, k in enumerate(pool.key) if k is not None} == pool.cached


def test_engine_plain_modules_import_no_torch():
    # The package __init__ re-exports LLM (torch), so stand in empty packages and check that
    # the scheduling modules' own imports stay torch-free.
    code = """
import importlib.util, sys, types
(root,) = importlib.util.find_spec("batchgen").submodule_search_locations
for name, path in (("batchgen", root), ("batchgen.engine", root + "/engine")):
    sys.modules[name] = pkg = types.ModuleType(name)
    pkg.__path__ = [path]
import batchgen.engine.block_pool, batchgen.engine.scheduler, batchgen.engine.sequence
import batchgen.engine.config, batchgen.engine.stopping
assert "torch" not in sys.modules, "torch imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_never_hands_out_the_scratch_block():
    pool = BlockPool(5, 4)
    assert (pool.num_usable, pool.num_free) == (4, 4)
    ids = pool.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4] and NULL_BLOCK not in ids
    assert pool.num_free == 0 and all(pool.ref_count[b] == 1 for b in ids)
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.release(ids)
    assert pool.num_free == 4
    _check(pool)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([ids[0]])
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, 4)


def test_blocks_for_rounds_up():
    pool = BlockPool(8, 4)
    assert [pool.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_free_list_is_lru_and_a_sequence_frees_its_last_blocks_first():
    pool = BlockPool(7, 4)
    a, b = pool.allocate(3), pool.allocate(3)
    assert (a, b) == ([1, 2, 3], [4, 5, 6])
    pool.release(a)  # reversed: 3, 2, 1 go to the back
    pool.release(b)
    assert list(pool.free) == [3, 2, 1, 6, 5, 4]
    assert pool.allocate(2) == [3, 2]  # least recently freed first
    _check(pool)


def test_chain_hashes_name_the_whole_prefix():
    toks = list(range(100, 110))  # 2 full blocks of 4, 2 tokens left over
    keys = chain_hashes(toks, 4)
    assert len(keys) == 2
    assert keys[0] == block_hash(None, toks[:4])
    assert keys[1] == block_hash(keys[0], toks[4:8])
    # the same tokens after another first block get another key
    other = chain_hashes([7, 7, 7, 7, *toks[4:8]], 4)
    assert other[1] != keys[1]
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [1, 2, 3, 5])
    assert chain_hashes([1, 2, 3], 4) == []


def test_cached_blocks_are_found_by_prefix_with_ref_counts_and_hit_counts():
    pool = BlockPool(9, 4)
    keys = _keys(3)
    a = pool.allocate(3)
    for blk, k in zip(a, keys, strict=True):
        pool.cache(blk, k)
    # a second holder of the first two blocks: one more reference each; the scheduler
    # records the lookup once its admission succeeds
    hit = pool.take_cached(keys[:2] + _keys(1, salt=9))
    assert hit == a[:2]
    assert [pool.ref_count[x] for x in a] == [2, 2, 1]
    assert (pool.hits, pool.queries) == (0, 0)
    pool.record_lookup(3, len(hit))
    assert (pool.hits, pool.queries) == (2, 3)
    # a lookup stops at the first miss, even if later keys are cached
    assert pool.take_cached([_keys(1, salt=9)[0], keys[1]]) == []
    # the first holder finishes: the shared blocks stay held by the second
    pool.release(a)
    assert [pool.ref_count[x] for x in a] == [1, 1, 0] and list(pool.free)[-1] == a[2]
    pool.release(hit)
    assert pool.num_free == 8
    _check(pool)
    # freed blocks keep their keys: a later prefix still hits, taking them off the free list
    again = pool.take_cached(keys)
    assert again == a and pool.num_free == 5 and all(pool.ref_count[x] == 1 for x in a)
    _check(pool)


def test_a_reused_block_loses_its_key_and_is_no_longer_a_hit():
    pool = BlockPool(3, 4)  # 2 usable blocks
    k1, k2 = _keys(1, salt=1)[0], _keys(1, salt=2)[0]
    (b,) = pool.allocate(1)
    pool.cache(b, k1)
    pool.release([b])
    # taking both free blocks reuses b for other tokens: its old key goes
    fresh = pool.allocate(2)
    assert b in fresh and pool.key[b] is None and k1 not in pool.cached
    pool.cache(b, k2)
    pool.release(fresh)
    assert pool.take_cached([k1]) == []
    assert pool.take_cached([k2]) == [b]
    _check(pool)


def test_eviction_takes_the_least_recently_used_cached_block():
    pool = BlockPool(5, 4)
    keys = [_keys(1, salt=s)[0] for s in range(4)]
    ids = pool.allocate(4)
    for blk, k in zip(ids, keys, strict=True):
        pool.cache(blk, k)
        pool.release([blk])  # freed in order 1, 2, 3, 4
    # a hit on block 1 makes it the most recently used once it is given back
    assert pool.take_cached(keys[:1]) == [ids[0]]
    pool.release([ids[0]])
    assert list(pool.free) == [ids[1], ids[2], ids[3], ids[0]]
    assert pool.allocate(3) == ids[1:]  # evicts 2, 3, 4 in that order
    assert pool.take_cached(keys[1:2]) == []  # evicted
    assert pool.take_cached(keys[:1]) == [ids[0]]  # survived
    _check(pool)


def test_a_prefix_cached_twice_keeps_the_first_block():
    pool = BlockPool(5, 4)
    (k,) = _keys(1)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a[0], k)
    pool.cache(b[0], k)  # another sequence computed the same prefix: b stays private
    assert pool.cached == {k: a[0]} and pool.key[b[0]] is None
    pool.cache(a[0], _keys(1, salt=5)[0])  # a cached block keeps its first key
    assert pool.cached == {k: a[0]}
    _check(pool)


def test_prefix_caching_off_never_caches_or_hits():
    pool = BlockPool(5, 4, prefix_caching=False)
    keys = _keys(2)
    ids = pool.allocate(2)
    for blk, k in zip(ids, keys, strict=True):
        pool.cache(blk, k)
    pool.release(ids)
    assert pool.cached == {} and pool.take_cached(keys) == []
    assert (pool.hits, pool.queries) == (0, 0)
    _check(pool)
