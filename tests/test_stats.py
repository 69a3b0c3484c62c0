"""stats.json agrees with the rows written, and the end-of-run table is printed unless --quiet."""

import json
import math

import pytest
from helpers import (
    EAGER,
    FAST,
    prompts,
    read_output,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    write_parquet,
)

LONG = "the quick brown fox jumps over the lazy dog. " * 8

FIELDS = (
    "rows",
    "rows_error",
    "rows_skipped_done",
    "prompt_tokens",
    "computed_prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
    "steps",
    "decode_steps",
    "decode_rows",
    "padded_rows",
    "preemptions",
    "load_s",
    "prefill_s",
    "decode_s",
    "compile_s",
    "capture_s",
    "compile_cache",
    "peak_memory_bytes",
    "wall_s",
    "rows_per_s",
    "prompt_tokens_per_s",
    "output_tokens_per_s",
    "decode_tokens_per_s",
    "prompt_compute_ratio",
    "decode_live_share",
    "model",
    "family",
    "device",
    "dtype",
    "compiled",
    "compiled_shapes",
    "kv_cache_tokens",
    "kv_cache_bytes",
    "prefix_cache_hit_rate",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "prefix_caching",
    "quantization",
    "complete",
    "ttft_s",
    "tpot_s",
    "latency_s",
    "latency_histograms",
    "mfu",
    "mbu",
    "peak_flops",
    "peak_bandwidth",
    "peak_source",
    "model_flops",
    "decode_bytes_read",
    "started_unix",
)
GONE = ("padding_efficiency", "batches", "schedule", "prefix_tokens_saved")


@pytest.fixture(scope="module")
def job(tiny_dirs, tmp_path_factory):
    """A run of 10 ok rows (several lengths and new-token limits) and 2 error rows."""
    d = tmp_path_factory.mktemp("stats")
    texts = [*prompts(10), None, LONG]
    limits = [2, 9, 5, 12, 3, 7, 1, 16, 4, 6, 4, 4]
    src = write_parquet(d / "in.parquet", {"prompt": texts, "max_new_tokens": limits})
    flags = ("--model", tiny_dirs["llama"], "--max-prompt-len", 32, "--max-num-seqs", 4)
    result = run_cli("run", src, "-o", d / "out", *flags, *EAGER)
    return src, flags, d / "out", result.stdout


def test_stats_fields_agree_with_the_output(job):
    _, _, out, _ = job
    stats = read_stats(out)
    assert set(FIELDS) <= stats.keys(), set(FIELDS) - stats.keys()
    assert not set(GONE) & stats.keys()
    rows = read_output(out).to_pylist()
    ok = [r for r in rows if r["error"] is None]
    assert stats["rows"] == len(rows) == 12
    assert stats["rows_error"] == len(rows) - len(ok) == 2
    assert stats["rows_skipped_done"] == 0
    assert stats["output_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    # no shared prefixes, no preemption: every prompt token computed exactly once
    assert stats["cached_prompt_tokens"] == 0 and stats["preemptions"] == 0
    assert stats["computed_prompt_tokens"] == stats["prompt_tokens"]
    assert stats["prompt_compute_ratio"] == stats["computed_prompt_tokens"] / stats["prompt_tokens"]
    assert stats["output_tokens_per_s"] > 0 and stats["rows_per_s"] > 0
    # rates are the counts over the wall time
    assert math.isclose(stats["output_tokens_per_s"] * stats["wall_s"], stats["output_tokens"])
    assert math.isclose(stats["rows_per_s"] * stats["wall_s"], stats["rows"])
    # each row's first token comes from its prefill, every later one from a decode row
    assert stats["decode_rows"] == stats["output_tokens"] - len(ok)
    assert stats["padded_rows"] == 0 and stats["decode_live_share"] == 1.0  # eager: no padding
    # 4 sequences at a time: at least 16 + 12 + ... tokens of decoding one at a time
    assert stats["decode_steps"] >= max(r["completion_tokens"] for r in rows) - 1
    assert stats["steps"] >= stats["decode_steps"] + 3  # 10 rows, 4 at a time: 3+ with prefill
    assert stats["peak_memory_bytes"] > 0
    assert stats["complete"] is True
    assert (stats["compiled"], stats["compile_s"], stats["compiled_shapes"]) == (False, 0.0, 0)
    assert (stats["family"], stats["device"], stats["dtype"]) == ("llama", "cpu", "float32")
    assert (stats["max_num_seqs"], stats["max_num_batched_tokens"], stats["block_size"]) == (
        4,
        2048,
        16,
    )
    assert stats["prefix_caching"] is True and stats["prefix_cache_hit_rate"] == 0.0
    # --kv-cache-tokens 4096: 256 blocks of 16, one of them scratch
    assert stats["kv_cache_tokens"] == 4096 - 16
    # the tiny llama: 2 layers x (k, v) x 2 kv heads x 8 dims x 4 bytes per token
    assert stats["kv_cache_bytes"] == 4096 * 2 * 2 * 2 * 8 * 4


def test_plan_agrees_with_the_run(job):
    src, flags, out, _ = job
    plan = json.loads(run_cli("plan", src, *flags, "--kv-cache-tokens", 4096, "--json").stdout)
    stats = read_stats(out)
    assert plan["rows"] == stats["rows"]
    assert plan["rows_error"] == stats["rows_error"]
    assert plan["prompt_tokens"] == stats["prompt_tokens"]
    assert plan["max_output_tokens"] >= stats["output_tokens"]
    assert plan["kv_cache_bytes"] == stats["kv_cache_bytes"]
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "prefix_caching"):
        assert plan[key] == stats[key], key


def test_shared_template_prefix_is_cached_and_changes_nothing(tmp_path, tiny_dirs):
    """Rows whose prompts share a long template prefix: with prefix caching (the default)
    later rows take its blocks from the cache; the rows written are the same as without."""
    texts = prompts(12)
    src = write_parquet(tmp_path / "in.parquet", {"text": texts})
    template = (
        "label the sentiment of this review: great product, would buy again. " * 2 + "{{ text }}"
    )
    common = (
        "--model",
        tiny_dirs["llama"],
        *FAST,
        "--template",
        template,
        "--max-new-tokens",
        6,
        "--with-token-ids",
        "--block-size",
        4,
        "--max-num-seqs",
        4,
    )
    run_cli("run", src, "-o", tmp_path / "on", *common)
    run_cli("run", src, "-o", tmp_path / "off", *common, "--no-prefix-caching")
    on, off = read_stats(tmp_path / "on"), read_stats(tmp_path / "off")
    assert on["prefix_caching"] is True and off["prefix_caching"] is False
    assert on["cached_prompt_tokens"] > 0 and 0 < on["prefix_cache_hit_rate"] <= 1
    assert on["prompt_compute_ratio"] < 1
    assert on["computed_prompt_tokens"] + on["cached_prompt_tokens"] == on["prompt_tokens"]
    assert off["cached_prompt_tokens"] == 0 and off["prefix_cache_hit_rate"] == 0.0
    assert off["computed_prompt_tokens"] == off["prompt_tokens"] == on["prompt_tokens"]
    assert rows_by_id(tmp_path / "on") == rows_by_id(tmp_path / "off")


def test_table_is_printed(job):
    _, _, out, stdout = job
    stats = read_stats(out)
    assert f"wrote {out}" in stdout
    assert "12 (2 errors, 0 done before)" in stdout
    for label in (
        "rows/s",
        "prompt tokens/s",
        "output tokens/s",
        "prefill / decode",
        "compile / capture",
        "model load",
        "peak memory",
    ):
        assert label in stdout, label
    assert f"prompt tokens computed  {stats['prompt_compute_ratio']:.1%} of real" in stdout
    assert f"decode rows live        {stats['decode_live_share']:.1%}" in stdout
    assert "eager (no compile)" in stdout  # the CPU's default


def test_quiet_prints_one_line(tmp_path, tiny_dirs):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    r = run_job(src, out, tiny_dirs["llama"], "--max-new-tokens", 2)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {out}: 3 rows")
    assert "prompt tokens computed" not in r.stdout
    assert "batchgen:" not in r.stderr  # no progress bar
    assert read_stats(out)["rows"] == 3


def test_run_stats_are_the_sum_of_step_reports():
    from batchgen.engine.sequence import Completion, FinishReason, StepReport
    from batchgen.stats.run_stats import RunStats

    ok = Completion(0, [5, 6, 7], FinishReason.LENGTH, prompt_tokens=4)
    bad = Completion(1, [], FinishReason.ERROR, prompt_tokens=9, error="too long")
    stats = RunStats()
    stats.add_step(StepReport(finished=[bad]))  # rejected before running: no step counted
    stats.add_step(StepReport(prompt_tokens=4, prefill=True, seconds=0.5))
    stats.add_step(StepReport(finished=[ok], decode_rows=1, seconds=0.25, cached_tokens=2))
    assert (stats.rows, stats.prompt_tokens, stats.output_tokens) == (0, 13, 3)  # none written
    stats.add_records([{"error": "too long"}, {"error": None}, {"error": "bad n: 0"}])
    assert (stats.rows, stats.rows_error, stats.error_reasons) == (
        3,
        2,
        {"too long": 1, "bad n: N": 1},
    )
    assert (stats.steps, stats.decode_steps, stats.prefill_s, stats.decode_s) == (2, 1, 0.5, 0.25)
    assert (stats.computed_prompt_tokens, stats.cached_prompt_tokens) == (4, 2)
