"""Sampled rows of a job are independent, yet each row's output is a function of the row alone:
the real CLI on a tiny random model, sampling at temperature 1."""

import pytest
from helpers import prompts, rows_by_id, run_job, write_parquet

from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.job.seeds import SEED_RANGE, row_seed

N = 8
SAMPLED = ("--temperature", 1.0, "--max-new-tokens", 8, "--ignore-eos", "--with-token-ids")


def _tokens(out, id_column: str = "id") -> dict:
    return {i: r["token_ids"] for i, r in rows_by_id(out, id_column).items()}


def test_row_seed_is_stable_and_separates_rows():
    # Pinned: a change here changes every sampled job's output, so it must be deliberate.
    assert row_seed(0, 0) == row_seed(0, 0) == 24407506
    seeds = {row_seed(s, i, k) for s in (0, 3) for i in (0, 1, "0", "1", b"1") for k in (0, 1)}
    assert len(seeds) == 20  # job seed, id, id type and sample index all count
    assert all(0 <= s < SEED_RANGE for s in seeds)


@pytest.mark.parametrize("seed", [-1, 2**31, 1.5])
def test_job_seed_out_of_range_is_a_config_error(seed):
    with pytest.raises(ConfigError, match="seed"):
        RunConfig(input="in.parquet", output="out", seed=seed)


@pytest.mark.parametrize("seed_flags", [(), ("--seed", 3)], ids=["no-seed", "seed-3"])
def test_identical_prompts_sample_independently_and_rerun_the_same(tmp_path, model, seed_flags):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the quick brown fox"] * N})
    run_job(src, tmp_path / "a", model, *SAMPLED, *seed_flags)
    first = _tokens(tmp_path / "a")
    assert len({tuple(t) for t in first.values()}) == N
    run_job(src, tmp_path / "b", model, *SAMPLED, *seed_flags)
    assert _tokens(tmp_path / "b") == first


def test_job_seed_changes_the_rows(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(N)})
    run_job(src, tmp_path / "s0", model, *SAMPLED)
    run_job(src, tmp_path / "s1", model, *SAMPLED, "--seed", 1)
    s0, s1 = _tokens(tmp_path / "s0"), _tokens(tmp_path / "s1")
    assert all(s0[i] != s1[i] for i in range(N))


def test_seed_column_pins_a_row_whatever_its_id(tmp_path, model):
    prompt = "label the sentiment of this review: great product"
    src = write_parquet(
        tmp_path / "in.parquet",
        {"key": ["a", "b", "c", "d"], "prompt": [prompt] * 4, "seed": [5, 5, None, None]},
    )
    other = write_parquet(
        tmp_path / "other.parquet", {"key": ["zz"], "prompt": [prompt], "seed": [5]}
    )
    for name, path in (("out", src), ("other", other)):
        run_job(path, tmp_path / name, model, *SAMPLED, "--id-column", "key", "--seed", 9)
    rows = _tokens(tmp_path / "out", "key")
    assert rows["a"] == rows["b"] == _tokens(tmp_path / "other", "key")["zz"]
    # without a seed value, rows fall back to their own derived seeds
    assert len({tuple(rows[k]) for k in "acd"}) == 3


def test_a_row_is_the_same_under_limit_and_in_another_order(tmp_path, model):
    ids = [f"r{i}" for i in range(N)]
    cols = {"key": ids, "prompt": ["the lazy dog"] * (N // 2) + prompts(N // 2)}
    src = write_parquet(tmp_path / "in.parquet", cols)
    flipped = write_parquet(tmp_path / "flip.parquet", {k: v[::-1] for k, v in cols.items()})
    runs = {"all": (src,), "flipped": (flipped,), "limit": (src, "--limit", 3)}
    for name, (path, *extra) in runs.items():
        run_job(
            path,
            tmp_path / name,
            model,
            *SAMPLED,
            "--id-column",
            "key",
            "--max-num-seqs",
            4 if name == "flipped" else 8,
            *extra,
        )
    full = _tokens(tmp_path / "all", "key")
    assert _tokens(tmp_path / "flipped", "key") == full
    limited = _tokens(tmp_path / "limit", "key")
    assert sorted(limited) == ids[:3] and all(limited[i] == full[i] for i in limited)
