"""Bucket planning invariants: plain Python, no torch, no model."""

import random
import subprocess
import sys

import pytest

from batchgen.planner import BatchPlan, BucketConfig, next_pow2, plan_batches

CONFIGS = [
    BucketConfig(),
    BucketConfig(max_prompt_len=100, min_bucket=8, max_batch=16, prefill_token_budget=512),
    BucketConfig(max_prompt_len=64, min_bucket=4, max_batch=32, kv_capacity_tokens=1024),
    BucketConfig(max_prompt_len=16, min_bucket=16, max_batch=1),
]


def _random_rows(cfg: BucketConfig, n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(1, cfg.max_prompt_len) for _ in range(n)]
    max_new = [rng.randint(1, 100) for _ in range(n)]
    return lens, max_new


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def test_planner_and_scheduler_import_no_torch():
    # The package __init__ re-exports LLM (torch), so stand in empty packages and check that
    # the planning modules' own imports stay torch-free.
    code = """
import importlib.util, sys, types
(root,) = importlib.util.find_spec("batchgen").submodule_search_locations
for name, path in (("batchgen", root), ("batchgen.engine", root + "/engine")):
    sys.modules[name] = pkg = types.ModuleType(name)
    pkg.__path__ = [path]
import batchgen.planner, batchgen.engine.scheduler, batchgen.engine.sequence
import batchgen.engine.stopping
assert "torch" not in sys.modules, "torch imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("n", [1, 7, 300])
def test_every_prompt_in_exactly_one_batch(cfg, n):
    lens, max_new = _random_rows(cfg, n, seed=n)
    plan = plan_batches(lens, max_new, cfg)
    seen = [i for b in plan.batches for i in b.indices]
    assert sorted(seen) == list(range(n))
    assert sum(plan.histogram.values()) == n


@pytest.mark.parametrize("cfg", CONFIGS)
def test_shapes_come_from_a_bounded_set(cfg):
    lens, max_new = _random_rows(cfg, 500, seed=1)
    plan = plan_batches(lens, max_new, cfg)
    edges = cfg.prompt_edges
    assert edges == sorted(set(edges)) and edges[-1] == cfg.max_prompt_len
    # powers of two from min_bucket, plus the cap
    assert all(e == cfg.min_bucket * 2**i for i, e in enumerate(edges[:-1]))
    for b in plan.batches:
        assert b.prompt_len in edges
        # each row sits in the smallest edge that holds it
        smaller = [e for e in edges if e < b.prompt_len]
        for i in b.indices:
            assert lens[i] <= b.prompt_len
            assert not smaller or lens[i] > smaller[-1]
        assert b.max_new >= max(max_new[i] for i in b.indices)
        assert _is_pow2(b.max_new) and b.max_new >= cfg.min_new_bucket
        assert b.row_stride == b.prompt_len + b.max_new
    # one batch-size per (edge, new bucket), plus smaller padded sizes for partial batches
    assert len({(b.prompt_len, b.max_new) for b in plan.batches}) <= len(edges)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_batch_sizes_are_powers_of_two_within_budgets(cfg):
    lens, max_new = _random_rows(cfg, 500, seed=2)
    plan = plan_batches(lens, max_new, cfg)
    for b in plan.batches:
        assert _is_pow2(b.batch_size)
        assert 1 <= len(b.indices) <= b.batch_size <= cfg.max_batch
        if b.batch_size > 1:  # a single row always runs, whatever the budget
            assert b.batch_size * b.prompt_len <= cfg.prefill_token_budget
            assert b.kv_tokens <= cfg.kv_capacity_tokens
        # padding rows are fewer than half the batch: no smaller power of two would fit
        assert len(b.indices) > b.batch_size // 2
    assert plan.max_kv_tokens == max(b.kv_tokens for b in plan.batches)


def test_short_buckets_get_bigger_batches():
    cfg = BucketConfig(max_prompt_len=1024, min_bucket=16, max_batch=64, prefill_token_budget=4096)
    sizes = [cfg.batch_size(e, 64) for e in cfg.prompt_edges]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == 64 and sizes[-1] == 4
    # the same in a plan: 200 short and 200 long prompts
    lens = [10] * 200 + [1000] * 200
    plan = plan_batches(lens, [64] * 400, cfg)
    short = {b.batch_size for b in plan.batches if b.prompt_len == 16}
    long = {b.batch_size for b in plan.batches if b.prompt_len == 1024}
    assert min(short) > max(long)


def test_kv_budget_limits_batch_size():
    cfg = BucketConfig(max_prompt_len=64, min_bucket=64, max_batch=64, kv_capacity_tokens=1000)
    # rows of 64 + 64 = 128 tokens: 1000 // 128 = 7 -> 4
    assert cfg.batch_size(64, 64) == 4
    plan = plan_batches([64] * 9, [50] * 9, cfg)
    assert [b.batch_size for b in plan.batches] == [4, 4, 1]
    assert [len(b.indices) for b in plan.batches] == [4, 4, 1]


def test_padding_efficiency_by_hand():
    cfg = BucketConfig(max_prompt_len=16, min_bucket=4, max_batch=4)
    # bucket 4: rows of 1 and 3 (batch 2); bucket 16: rows 9, 16, 10 (batch 4, one dummy row)
    plan = plan_batches([1, 9, 3, 16, 10], [8] * 5, cfg)
    assert plan.real_prompt_tokens == 1 + 9 + 3 + 16 + 10
    assert plan.computed_prompt_tokens == 2 * 4 + 4 * 16
    assert plan.padding_efficiency == pytest.approx(39 / 72)
    assert plan.histogram == {4: 2, 16: 3}
    assert plan.shapes == {(2, 4, 16), (4, 16, 16)}


@pytest.mark.parametrize("cfg", CONFIGS)
def test_padding_efficiency_matches_batches(cfg):
    lens, max_new = _random_rows(cfg, 123, seed=3)
    plan = plan_batches(lens, max_new, cfg)
    assert plan.real_prompt_tokens == sum(lens)
    assert plan.computed_prompt_tokens == sum(b.batch_size * b.prompt_len for b in plan.batches)
    assert 0 < plan.padding_efficiency <= 1


def test_empty_plan():
    plan = plan_batches([], [], BucketConfig())
    assert plan.batches == [] and plan.padding_efficiency == 1.0 and plan.max_kv_tokens == 0


def test_longest_bucket_first_and_rows_sorted_within():
    cfg = BucketConfig(max_prompt_len=64, min_bucket=8, max_batch=2)
    lens = [5, 60, 20, 7, 33, 3, 61]
    plan = plan_batches(lens, [16] * len(lens), cfg)
    edges = [b.prompt_len for b in plan.batches]
    assert edges == sorted(edges, reverse=True)
    for b in plan.batches:
        assert [lens[i] for i in b.indices] == sorted(lens[i] for i in b.indices)


def test_non_power_of_two_cap():
    cfg = BucketConfig(max_prompt_len=100, min_bucket=16)
    assert cfg.prompt_edges == [16, 32, 64, 100]
    assert cfg.prompt_bucket(65) == 100 and cfg.prompt_bucket(100) == 100
    assert cfg.prompt_bucket(1) == 16 and cfg.prompt_bucket(17) == 32
    assert BucketConfig(max_prompt_len=8, min_bucket=16).prompt_edges == [8]


def test_too_long_prompt_and_bad_config_raise():
    cfg = BucketConfig(max_prompt_len=32)
    with pytest.raises(ValueError, match="exceeds max_prompt_len 32"):
        plan_batches([10, 33], [8, 8], cfg)
    with pytest.raises(ValueError):
        BucketConfig(max_batch=0)
    with pytest.raises(ValueError):
        BucketConfig(min_bucket=0)


def test_new_token_bucket_and_helpers():
    cfg = BucketConfig(min_new_bucket=16)
    assert [cfg.new_tokens_bucket(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1000)] == [1, 2, 4, 4, 8, 1024]
    assert cfg.padded_batch(3, 64) == 4 and cfg.padded_batch(5, 4) == 4
    b = BatchPlan(indices=(0, 1, 2), prompt_len=32, batch_size=4, max_new=16)
    assert b.row_stride == 48 and b.kv_tokens == 192
