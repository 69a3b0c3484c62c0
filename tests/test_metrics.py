"""The field's metrics on tiny real runs: per-row timings (--with-timings), their percentiles
in stats.json, model FLOPs and bytes checked by hand on the 2-layer tiny Llama, MFU/MBU, the
step timeline (.steps.parquet), and timings on resume."""

import json
import math

import pytest
from helpers import prompts, read_output, read_stats, run_job, write_parquet

from batchgen.data.layout import SUCCESS_FILE
from batchgen.stats.steps import read_steps

PEAKS = ("--peak-tflops", 1, "--peak-bandwidth-gbs", 10)
QS = ("p50", "p90", "p99")


def _ordered(summary: dict) -> None:
    values = [summary[q] for q in QS]
    assert all(v is not None and v > 0 for v in values), summary
    assert values == sorted(values) and values[-1] <= summary["max"], summary


def test_flops_and_bytes_by_hand(model, tmp_path):
    """One row, greedy, EOS ignored: a prefill of its P prompt tokens, then N - 1 decode steps.

    The tiny Llama: dim 32, 2 layers, 4 heads and 2 KV heads of head_dim 8, MLP 64 (gated),
    vocab 512, untied embeddings, float32.
      layer params  = 2 * (32 * (4 + 2 * 2) * 8 + 4 * 8 * 32 + 3 * 32 * 64) = 18432
      LM head       = 512 * 32 = 16384
      attention     = 4 * layers * heads * head_dim = 4 * 2 * 4 * 8 = 256 FLOPs per key
      KV per token  = 2 (K, V) * 2 layers * 2 KV heads * 8 * 4 bytes = 256 bytes
      weights read  = all parameters but the input embedding: 4 * (18432 + 16384 + 5 * 32)
                      (5 norms of 32) = 139904 bytes
    The prefill's tokens attend to 1 + 2 + ... + P keys and use one row of logits; decode
    step s (1 <= s < N) computes the token at position P + s - 1, attending to P + s keys.
    """
    n = 5
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [prompts(1)[0]]})
    run_job(src, tmp_path / "out", model, "--max-new-tokens", n, "--ignore-eos", *PEAKS)
    stats = read_stats(tmp_path / "out")
    p = stats["prompt_tokens"]
    decode_keys = sum(p + s for s in range(1, n))
    flops = 2 * 18432 * (p + n - 1) + 256 * (p * (p + 1) // 2 + decode_keys) + 2 * 16384 * n
    assert stats["model_flops"] == flops
    assert stats["weights_read_bytes"] == 139904 == stats["weights_bytes_per_rank"] - 512 * 32 * 4
    assert stats["decode_bytes_read"] == (n - 1) * 139904 + 256 * decode_keys
    assert stats["peak_flops"] == 1e12 and stats["peak_bandwidth"] == 10e9
    mfu = flops / stats["model_flops_s"] / 1e12
    assert stats["mfu"] == pytest.approx(mfu) and 0 < stats["mfu"] <= 1
    mbu = stats["decode_bytes_read"] / stats["decode_bytes_s"] / 10e9
    assert stats["mbu"] == pytest.approx(mbu) and 0 < stats["mbu"] <= 1
    assert stats["decode_bytes_s"] == pytest.approx(stats["decode_s"])


def test_timings_per_sample_and_their_percentiles(model, tmp_path):
    texts = [*prompts(7), None]  # the last row: an error record
    limits = [1, 3, 8, 2, 12, 5, 7, 4]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts, "max_new_tokens": limits})
    out = tmp_path / "out"
    flags = ("--with-timings", "--n", 2, "--temperature", 0.8, "--max-num-seqs", 4, *PEAKS)
    run_job(src, out, model, *flags)
    rows = read_output(out).to_pylist()
    assert len(rows) == 16
    for r in rows:
        if r["error"] is not None:
            assert r["queued_s"] is r["ttft_s"] is r["latency_s"] is r["tpot_s"] is None
            continue
        assert r["queued_s"] >= 0 and 0 < r["ttft_s"] <= r["latency_s"]
        k = r["completion_tokens"]
        if k > 1:
            assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"]) / (k - 1))
        else:
            assert r["tpot_s"] is None and r["ttft_s"] == r["latency_s"]
    stats = read_stats(out)
    for key in ("ttft_s", "latency_s", "tpot_s"):
        _ordered(stats[key])
    ok = [r for r in rows if r["error"] is None]
    assert stats["latency_s"]["max"] == pytest.approx(max(r["latency_s"] for r in ok))
    mean = sum(r["ttft_s"] for r in ok) / len(ok)
    assert stats["ttft_s"]["mean"] == pytest.approx(mean)
    # percentiles within the histogram's 1% buckets of the exact nearest-rank ones
    lat = sorted(r["latency_s"] for r in ok)
    for q in QS:
        exact = lat[max(1, math.ceil(float(q[1:]) / 100 * len(lat))) - 1]
        assert stats["latency_s"][q] == pytest.approx(exact, rel=0.011)
    assert 0 < stats["mfu"] <= 1 and 0 < stats["mbu"] <= 1


def test_timings_as_lists_with_n_as_list(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    flags = ("--with-timings", "--n", 2, "--n-as-list", "--temperature", 0.8)
    run_job(src, tmp_path / "out", model, *flags, "--max-new-tokens", 4)
    for r in read_output(tmp_path / "out").to_pylist():
        assert len(r["ttft_s"]) == len(r["latency_s"]) == 2
        assert all(t <= lat for t, lat in zip(r["ttft_s"], r["latency_s"], strict=True))


def test_step_timeline_agrees_with_the_stats(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(10)})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-num-seqs", 3, "--max-new-tokens", 6)
    stats, steps = read_stats(out), read_steps(out).to_pydict()
    assert len(steps["t_s"]) == stats["steps"]
    assert steps["t_s"] == sorted(steps["t_s"]) and all(t > 0 for t in steps["step_s"])
    assert sum(steps["decode_rows"]) == stats["decode_rows"]
    assert sum(steps["sampled_tokens"]) == stats["output_tokens"]  # no stop strings: all kept
    assert sum(steps["prefill_tokens"]) == stats["computed_prompt_tokens"]
    assert sum(steps["cached_tokens"]) == stats["cached_prompt_tokens"]
    assert sum(steps["preemptions"]) == stats["preemptions"]
    blocks = {u + f for u, f in zip(steps["kv_blocks_used"], steps["kv_blocks_free"], strict=True)}
    assert blocks == {stats["kv_cache_tokens"] // stats["block_size"]}
    assert max(steps["waiting"]) > 0 and steps["waiting"][-1] == 0
    assert max(steps["decode_rows"]) <= 3
    assert stats["mfu"] is None and stats["peak_source"] == "unknown"  # no probe in tests


def test_a_resumed_run_times_the_rows_it_computed(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(9)})
    out = tmp_path / "out"
    run_job(src, out, model, "--with-timings", "--rows-per-part", 4)
    for name in ("part-00001.parquet", "part-00002.parquet", SUCCESS_FILE):  # as if killed
        (out / name).unlink()
    first = {r["id"]: r for r in read_output(out).to_pylist()}
    run_job(src, out, model, "--with-timings")
    stats = read_stats(out)
    assert stats["rows_skipped_done"] == 4 and stats["rows"] == 5
    hist = stats["latency_histograms"]["latency_s"]
    assert sum(hist["counts"].values()) == 5  # this run's rows only
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert len(rows) == 9 and all(rows[i] == first[i] for i in first)
    assert all(rows[i]["ttft_s"] <= rows[i]["latency_s"] for i in range(9))


def test_stats_json_has_the_latency_keys_without_the_columns(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    run_job(src, tmp_path / "out", model)
    stats = read_stats(tmp_path / "out")
    assert "ttft_s" not in read_output(tmp_path / "out").column_names
    for key in ("ttft_s", "tpot_s", "latency_s"):
        assert set(stats[key]) == {"p50", "p90", "p99", "mean", "max"}
    assert json.loads(json.dumps(stats)) == stats
