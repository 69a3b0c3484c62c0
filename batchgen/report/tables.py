"""The report's tables, as (name, value) rows: the headline figures from stats.json, the
job's command and options from job.json, and how the rows ended (outcomes.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from batchgen.report.charts import phases
from batchgen.report.outcomes import Outcomes

# job.json keys that are not options of the command (file fingerprints, where it ran)
_NOT_OPTIONS = {"input", "output", "model", "input_files", "model_files", "shard"}


def _ms(d: dict[str, Any] | None) -> str:
    if not d or d.get("p50") is None:
        return "-"
    return " / ".join(f"{d[q] * 1e3:.1f}" for q in ("p50", "p90", "p99", "max")) + " ms"


def utilisation(s: dict[str, Any], key: str) -> str:
    """MFU or MBU, or why there is none: no peak known, or nothing to measure against it."""
    value, peak = s.get(key), s.get("peak_flops" if key == "mfu" else "peak_bandwidth")
    if value is not None and s.get("peak_under_load"):
        return (
            "- (the CPU peaks were probed under load, so it would read high: pass "
            "--peak-tflops / --peak-bandwidth-gbs)"
        )
    if value is not None:
        return f"{value:.2%}"
    if not peak:
        return "- (no peak known: pass --peak-tflops / --peak-bandwidth-gbs)"
    if key == "mbu":
        return "- (no decode steps timed: nothing to measure against the peak)"
    return "- (no model FLOPs counted for this model)"


def _when(unix: float | None) -> str:
    if unix is None:
        return "-"
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def prefill_only(s: dict[str, Any]) -> bool:
    """A job that sampled nothing (task score, prompt-logprobs, embed, classify): its page has
    no decode series, no TPOT or MBU, and no decode ceiling."""
    return not s.get("output_tokens") and not s.get("decode_steps")


def stats_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The table of headline figures, from a run's or a merge's stats.json."""
    merged = "per_shard" in s
    wall = s.get("wall_s", s.get("max_wall_s", 0.0)) or 0.0
    basis = " (the shards' run intervals, overlaps once)" if merged and "wall_s" in s else ""
    if merged and "wall_s" not in s:
        basis = " (slowest shard)"
    errors = s.get("rows_error", 0)
    start = s.get("started_unix")
    rows = [
        (
            "rows",
            f"{s.get('rows', 0)} ({errors} errors, "
            f"{s.get('rows_skipped_done', 0)} from an earlier run)",
        ),
        ("started", _when(start)),
        ("ended", _when(s.get("ended_unix") or (s["started_unix"] + wall if start else None))),
        ("wall time", f"{wall:.2f} s{basis}"),
        ("rows / s", f"{s.get('rows_per_s', 0.0):.2f}"),
        ("output tokens / s", f"{s.get('output_tokens_per_s', 0.0):.1f}"),
        ("TTFT p50 / p90 / p99 / max", _ms(s.get("ttft_s"))),
        ("TPOT p50 / p90 / p99 / max", _ms(s.get("tpot_s"))),
        ("latency p50 / p90 / p99 / max", _ms(s.get("latency_s"))),
        ("MFU", utilisation(s, "mfu")),
        ("MBU (decode steps)", utilisation(s, "mbu")),
    ]
    if prefill_only(s):  # nothing decoded: prompt tokens/s, no TPOT (TTFT is the latency)
        prompt = ("prompt tokens / s", f"{s.get('prompt_tokens_per_s', 0.0):.1f}")
        rows = [prompt if k == "output tokens / s" else (k, v) for k, v in rows]
        rows = [(k, v) for k, v in rows if not k.startswith(("TTFT", "TPOT", "MBU"))]
    if s.get("peak_flops") or s.get("peak_bandwidth"):
        flops = f"{s['peak_flops'] / 1e12:.3g} TFLOP/s" if s.get("peak_flops") else "- TFLOP/s"
        bw = f"{s['peak_bandwidth'] / 1e9:.3g} GB/s" if s.get("peak_bandwidth") else "- GB/s"
        rows.append(("peaks", f"{flops}, {bw} ({s.get('peak_source')})"))
    if "prefix_cache_hit_rate" in s:
        rows.append(("prefix cache hit rate", f"{s['prefix_cache_hit_rate']:.1%}"))
    if "preemptions" in s:
        rows.append(("preemptions", str(s["preemptions"])))
    if s.get("gpu_util_mean_pct") is not None:
        rows.append(
            ("GPU SM % mean / max", f"{s['gpu_util_mean_pct']:.0f}% / {s['gpu_util_max_pct']}%")
        )
        if s.get("gpu_mem_util_mean_pct") is not None:
            mem = f"{s['gpu_mem_util_mean_pct']:.0f}% / {s['gpu_mem_util_max_pct']}%"
            rows.append(("GPU memory busy mean / max", mem))
        if s.get("gpu_power_mean_w") is not None:
            power = f"{s['gpu_power_mean_w']:.0f} W / {s['gpu_power_max_w']:.0f} W"
            rows.append(("GPU power mean / max", power))
    for key in ("model", "device", "dtype", "max_num_seqs", "shards"):
        if s.get(key) is not None:
            rows.append((key.replace("_", " "), str(s[key])))
    return rows


def time_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Each phase's seconds and share of the whole job (start-up included)."""
    parts = phases(s)
    total = sum(sec for _, sec, _ in parts)
    rows = [(label, f"{sec:.2f} s ({sec / total:.1%})") for label, sec, _ in parts if total]
    if "per_shard" in s:
        rows.append(("note", "summed over the shards (shard-seconds)"))
    if s.get("compile_s") and s.get("steps"):
        rows.append(("note", "a compile after the warm-up is also in its step's time"))
    return rows


def option_rows(job: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("--" + k.replace("_", "-"), "-" if v is None else str(v))
        for k, v in sorted(job.items())
        if k not in _NOT_OPTIONS
    ]


def outcome_rows(o: Outcomes) -> list[tuple[str, str]]:
    total = o.rows or 1
    return [
        (reason, f"{n} ({n / total:.1%})")
        for reason, n in sorted(o.finish_reasons.items(), key=lambda kv: -kv[1])
    ]
