"""What each shard directory of a sharded output holds: `scan(OUT)` reads every shard's
state (complete, interrupted, running or killed, missing), parts, stats.json and job.json
into a `ShardReport`; `MergeSummary` is their sum, printed as a table and merged into
OUT/.batchgen/stats.json by merge.py."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.data.verdict import ErrorVerdict
from batchgen.data.writer import JOB_FILE, STATS_FILE, SUCCESS_FILE
from batchgen.errors import MergeError
from batchgen.job.shard import Shard


class IncompleteOutput(MergeError):
    """Some shards are missing, unfinished or from another job; `problems` says which."""

    def __init__(self, out: str, problems: list[str], todo: list[int]) -> None:
        self.problems, self.todo = problems, todo
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(
            f"{out} is not ready to merge:\n{lines}\n"
            f"shards to (re)run: {','.join(map(str, todo)) or 'none'} (rerunning a shard resumes "
            "it)"
        )


class ShardState(str, enum.Enum):
    MISSING = "missing"  # no directory: never started
    RUNNING_OR_KILLED = "incomplete"  # a directory without SUCCESS and no final stats
    INTERRUPTED = "interrupted"  # stopped by a signal or an error after writing its stats
    COMPLETE = "complete"


@dataclass(slots=True)
class ShardReport:
    shard: Shard
    state: ShardState
    path: Path
    parts: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # its stats.json (last run)
    fingerprint: dict[str, Any] | None = None
    rows: int = 0  # from the data, filled in by merge
    rows_error: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def wall_s(self) -> float:
        return float(self.stats.get("wall_s", 0.0))

    @property
    def resumed(self) -> bool:
        return bool(self.stats.get("rows_skipped_done"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": str(self.shard),
            "state": self.state.value,
            "rows": self.rows,
            "rows_error": self.rows_error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            # the rate of the last run alone: a resumed shard's earlier runs are not timed in it
            "output_tokens_per_s": float(self.stats.get("output_tokens_per_s", 0.0)),
            "resumed": self.resumed,
            "device": self.stats.get("device"),
        }


@dataclass(slots=True)
class MergeSummary:
    out: Path
    shards: list[ShardReport]
    merged_file: Path | None
    verdict: ErrorVerdict | None = None  # the job's error rate (--workers: over every shard)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.shards)

    @property
    def max_wall_s(self) -> float:
        # The shards ran side by side, so the job took as long as its slowest shard.
        return max((s.wall_s for s in self.shards), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        wall = self.max_wall_s
        return {
            "shards": len(self.shards),
            "rows": self.rows,
            "rows_error": sum(s.rows_error for s in self.shards),
            "prompt_tokens": sum(s.prompt_tokens for s in self.shards),
            "output_tokens": self.output_tokens,
            "max_wall_s": wall,
            "rows_per_s": self.rows / wall if wall else 0.0,
            "output_tokens_per_s": self.output_tokens / wall if wall else 0.0,
            "merged_file": self.merged_file.name if self.merged_file else None,
            "per_shard": [s.to_dict() for s in self.shards],
        }

    def table(self) -> str:
        d = self.to_dict()
        head = ("shard", "rows", "errors", "out tokens", "wall s", "out tok/s", "device")
        rows = [
            (
                s["shard"] + (" (resumed)" if s["resumed"] else ""),
                str(s["rows"]),
                str(s["rows_error"]),
                str(s["output_tokens"]),
                f"{s['wall_s']:.2f}",
                f"{s['output_tokens_per_s']:.1f}",
                str(s["device"] or "-"),
            )
            for s in d["per_shard"]
        ]
        total = (
            "total",
            str(d["rows"]),
            str(d["rows_error"]),
            str(d["output_tokens"]),
            f"{d['max_wall_s']:.2f}",
            f"{d['output_tokens_per_s']:.1f}",
            "(max wall)",
        )
        widths = [max(len(r[i]) for r in [head, *rows, total]) for i in range(len(head))]

        def fmt(r):
            return "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )

        rule = "  ".join("-" * w for w in widths)
        lines = [fmt(head), rule, *map(fmt, rows), rule, fmt(total)]
        where = f"\nmerged into {self.merged_file}" if self.merged_file else ""
        return "\n".join(lines) + where


def scan(out: str | os.PathLike[str]) -> list[ShardReport]:
    """A report for every shard 0..N-1 of OUT, missing ones included."""
    root = Path(out)
    if not root.is_dir():
        raise MergeError(f"{root} is not a directory")
    found = {}
    for p in sorted(root.iterdir()):
        shard = Shard.from_dirname(p.name)
        if shard is not None and p.is_dir():
            found[shard] = p
    if not found:
        raise MergeError(
            f"{root} has no shard-IIIII-of-NNNNN directories; merge combines the output of "
            "`batchgen run --shard I/N` (or `batchgen slurm`) runs"
        )
    counts = sorted({s.count for s in found})
    if len(counts) > 1:
        listing = ", ".join(f"{sum(s.count == n for s in found)} of {n}" for n in counts)
        raise MergeError(
            f"{root} holds shards of {len(counts)} different splits ({listing}); "
            "delete the directories of the split you do not want, or use another output"
        )
    n = counts[0]
    return [_report(Shard(i, n), root / Shard(i, n).dirname) for i in range(n)]


def _report(shard: Shard, path: Path) -> ShardReport:
    if not path.is_dir():
        return ShardReport(shard, ShardState.MISSING, path)
    stats = read_json(path / STATS_FILE) or {}
    if (path / SUCCESS_FILE).exists():
        state = ShardState.COMPLETE
    elif stats.get("complete") is False:
        state = ShardState.INTERRUPTED
    else:
        state = ShardState.RUNNING_OR_KILLED
    parts = sorted(p.name for p in path.glob("part-*.parquet"))
    return ShardReport(shard, state, path, parts, stats, read_json(path / JOB_FILE))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
