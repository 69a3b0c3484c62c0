"""The shards' metrics as one job's: latency percentiles from the sum of their histograms,
MFU and MBU over all their step time, and one step timeline.

Each shard ran on its own device, so a merged MFU is the FLOPs of all shards over what their
devices could have done in their step time, sum(FLOPs) / sum(step seconds x peak), which is
the step-time-weighted mean of the shards' MFUs (MBU likewise over decode time and bandwidth).
Rates are over the union of the shards' run intervals ([started_unix, started_unix + wall_s]
of each): shards side by side count their overlap once, shards run one after the other (as
`make label` runs its two) count both, where the slowest shard's wall alone would overstate
the rate. A shard without `started_unix` (an older batchgen) falls back to the longest wall.
The timeline puts every shard's steps on one clock: a step's `t_s` plus its shard's start
(`started_unix` in its stats.json) less the earliest shard's, with a `shard` column.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.writer import STEPS_FILE, write_file
from batchgen.scaleout.shard_report import ShardReport
from batchgen.stats.latency import Latencies
from batchgen.stats.steps import read_steps

# Per-token costs: the same model in every shard, taken from the first.
_SAME = (
    "model_flops_per_token",
    "head_flops_per_row",
    "head",
    "head_on_every_prompt_token",
    "weights_read_bytes",
    "kv_bytes_per_token",
)


def merged_metrics(reports: list[ShardReport]) -> dict[str, Any]:
    """stats.json's latency, roofline and peak keys for the shards together."""
    stats = [r.stats for r in reports if r.stats]
    lat = Latencies()
    for s in stats:
        if "latency_histograms" in s:
            lat.merge(Latencies.from_dict(s["latency_histograms"]))
    out: dict[str, Any] = {**lat.summary(), "latency_histograms": lat.to_dict()}
    out["rows_skipped_done"] = sum(s.get("rows_skipped_done", 0) for s in stats)
    out.update({k: stats[0].get(k) for k in _SAME} if stats else {})
    out.update(_utilisation(stats))
    # Where the time went, in shard-seconds (the report's breakdown; shards side by side
    # add up to more than the job's wall time)
    for key in (
        "startup_s",
        "load_s",
        "compile_s",
        "capture_s",
        "warmup_s",
        "prefill_s",
        "decode_s",
    ):
        out[key] = sum(s.get(key) or 0.0 for s in stats)
    out["total_wall_s"] = sum((s.get("startup_s") or 0.0) + (s.get("wall_s") or 0.0) for s in stats)
    return out


def union_wall_s(reports: list[ShardReport]) -> float:
    """Seconds in which at least one shard's last run was running (see the module doc)."""
    spans = sorted(
        (float(r.stats["started_unix"]), float(r.stats["started_unix"]) + r.wall_s)
        for r in reports
        if r.stats.get("started_unix") is not None
    )
    if len(spans) < sum(1 for r in reports if r.stats):
        return max((r.wall_s for r in reports), default=0.0)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def job_rates(reports: list[ShardReport], rows: int, output_tokens: int) -> dict[str, Any]:
    """The merged job's start, wall time and rates over the union of the shards' intervals."""
    wall = union_wall_s(reports)
    starts = [r.stats["started_unix"] for r in reports if r.stats.get("started_unix")]
    ends = [r.stats["started_unix"] + r.wall_s for r in reports if r.stats.get("started_unix")]
    return {
        "started_unix": min(starts) if starts else None,
        "ended_unix": max(ends) if ends else None,
        "wall_s": wall,
        "wall_basis": "union of the shards' run intervals",
        "rows_per_s": rows / wall if wall else 0.0,
        "output_tokens_per_s": output_tokens / wall if wall else 0.0,
    }


def _utilisation(stats: list[dict[str, Any]]) -> dict[str, Any]:
    def ratio(work: str, seconds: str, peak: str) -> float | None:
        done = sum(s.get(work) or 0 for s in stats)
        possible = sum((s.get(seconds) or 0) * (s.get(peak) or 0) for s in stats)
        if any(s.get(peak) is None for s in stats) or not possible:
            return None  # a shard without a known peak: no whole-job figure
        return done / possible

    peaks = {(s.get("peak_flops"), s.get("peak_bandwidth"), s.get("peak_source")) for s in stats}
    flops, bw, source = peaks.pop() if len(peaks) == 1 else (None, None, "differs by shard")
    return {
        "model_flops": sum(s.get("model_flops") or 0 for s in stats),
        "decode_bytes_read": sum(s.get("decode_bytes_read") or 0 for s in stats),
        "mfu": ratio("model_flops", "model_flops_s", "peak_flops"),
        "mbu": ratio("decode_bytes_read", "decode_bytes_s", "peak_bandwidth"),
        "peak_flops": flops,
        "peak_bandwidth": bw,
        "peak_source": source,
    }


def merge_steps(reports: list[ShardReport], root: str | os.PathLike[str]) -> int:
    """Write root/STEPS_FILE from the shards' (on one clock, with a shard column); the
    number of steps. Nothing is written when no shard has a timeline."""
    tables = []
    starts = [r.stats.get("started_unix") for r in reports]
    first = min((s for s in starts if s is not None), default=0.0)
    for r, start in zip(reports, starts, strict=True):
        t = read_steps(r.path)
        if t is None:
            continue
        shifted = pc.add(t.column("t_s"), (start or first) - first)
        t = t.set_column(0, "t_s", shifted)
        tables.append(t.append_column("shard", pa.array([r.shard.index] * t.num_rows, pa.int32())))
    if not tables:
        return 0
    merged = pa.concat_tables(tables).sort_by("t_s")
    write_file(root, STEPS_FILE, lambda f: pq.write_table(merged, f))
    return merged.num_rows
