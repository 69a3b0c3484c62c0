"""_stats.json agrees with the rows written, and the end-of-run table is printed unless --quiet."""

import json
import math

import pytest
from helpers import EAGER, FAST, prompts, read_output, read_stats, run_cli, write_parquet

LONG = "the quick brown fox jumps over the lazy dog. " * 8

FIELDS = (
    "rows", "rows_error", "rows_skipped_done", "prompt_tokens", "computed_prompt_tokens",
    "output_tokens", "batches", "load_s", "prefill_s", "decode_s", "compile_s", "decode_steps",
    "peak_memory_bytes", "wall_s", "rows_per_s", "prompt_tokens_per_s", "output_tokens_per_s",
    "decode_tokens_per_s", "padding_efficiency", "model", "family", "device", "dtype",
    "compiled", "kv_cache_tokens", "quantization", "complete",
)  # fmt: skip


@pytest.fixture(scope="module")
def job(tiny_dirs, tmp_path_factory):
    """A run of 10 ok rows (several lengths and new-token limits) and 2 error rows."""
    d = tmp_path_factory.mktemp("stats")
    texts = [*prompts(10), None, LONG]
    limits = [2, 9, 5, 12, 3, 7, 1, 16, 4, 6, 4, 4]
    src = write_parquet(d / "in.parquet", {"prompt": texts, "max_new_tokens": limits})
    flags = ("--model", tiny_dirs["llama"], "--max-prompt-len", 32, "--max-batch", 4)
    result = run_cli("run", src, "-o", d / "out", *flags, *EAGER)
    return src, flags, d / "out", result.stdout


def test_stats_fields_agree_with_the_output(job):
    _, _, out, _ = job
    stats = read_stats(out)
    assert set(FIELDS) <= stats.keys(), set(FIELDS) - stats.keys()
    rows = read_output(out).to_pylist()
    ok = [r for r in rows if r["error"] is None]
    assert stats["rows"] == len(rows) == 12
    assert stats["rows_error"] == len(rows) - len(ok) == 2
    assert stats["rows_skipped_done"] == 0
    assert stats["output_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert stats["computed_prompt_tokens"] >= stats["prompt_tokens"]
    assert 0 < stats["padding_efficiency"] <= 1
    assert stats["padding_efficiency"] == pytest.approx(
        stats["prompt_tokens"] / stats["computed_prompt_tokens"]
    )
    assert stats["output_tokens_per_s"] > 0 and stats["rows_per_s"] > 0
    # rates are the counts over the wall time
    assert math.isclose(stats["output_tokens_per_s"] * stats["wall_s"], stats["output_tokens"])
    assert math.isclose(stats["rows_per_s"] * stats["wall_s"], stats["rows"])
    assert stats["batches"] >= 3  # 10 ok rows, at most 4 to a batch
    # a batch decodes until its longest row is done
    assert stats["decode_steps"] >= max(r["completion_tokens"] for r in rows) - 1
    assert stats["peak_memory_bytes"] > 0
    assert stats["complete"] is True
    assert (stats["compiled"], stats["compile_s"]) == (False, 0.0)
    assert (stats["family"], stats["device"], stats["dtype"]) == ("llama", "cpu", "float32")
    assert stats["kv_cache_tokens"] == 4096


def test_plan_predicts_the_runs_padding(job):
    src, flags, out, _ = job
    plan = json.loads(run_cli("plan", src, *flags, "--kv-cache-tokens", 4096, "--json").stdout)
    stats = read_stats(out)
    assert plan["rows"] == stats["rows"]
    assert plan["rows_error"] == stats["rows_error"]
    assert plan["prompt_tokens"] == stats["prompt_tokens"]
    assert plan["padding_efficiency"] == pytest.approx(stats["padding_efficiency"])
    assert sum(b["count"] for b in plan["batches"]) == stats["batches"]


def test_table_is_printed(job):
    _, _, out, stdout = job
    stats = read_stats(out)
    assert f"wrote {out}" in stdout
    assert "12 (2 errors, 0 done before)" in stdout
    for label in ("rows/s", "prompt tokens/s", "output tokens/s", "prefill / decode",
                  "compile + warm-up", "model load", "peak memory"):  # fmt: skip
        assert label in stdout, label
    assert f"padding efficiency  {stats['padding_efficiency']:.1%}" in stdout


def test_quiet_prints_one_line(tmp_path, tiny_dirs):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    r = run_cli("run", src, "-o", out, "--model", tiny_dirs["llama"], *FAST, "--max-new-tokens", 2)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {out}: 3 rows")
    assert "padding efficiency" not in r.stdout
    assert "batchgen:" not in r.stderr  # no progress bar
    assert read_stats(out)["rows"] == 3
