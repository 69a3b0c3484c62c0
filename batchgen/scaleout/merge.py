"""Merge a sharded output: check that every shard finished, then combine data and statistics.

A sharded job (`batchgen run --shard I/N`, `batchgen slurm`, `batchgen run --workers`) leaves

    OUT/shard-00000-of-00003/   an ordinary output directory (parts, _job.json, _stats.json,
    OUT/shard-00001-of-00003/   _SUCCESS) per shard
    OUT/shard-00002-of-00003/

and `merge(OUT)` adds

    OUT/merged.parquet   every shard's rows in one file (shard 0's parts first, then shard 1's,
                         ...: grouped by shard, not in input order), same columns as the parts
                         (the id column under its input name, as in _job.json's id_column)
    OUT/_stats.json      totals, throughput and a per-shard table
    OUT/_SUCCESS         written last

Nothing is merged unless every shard 0..N-1 has its _SUCCESS, all shards agree on N, and their
_job.json fingerprints agree (apart from the shard itself); otherwise `IncompleteOutput` names
the shards by number. Row counts, errors and tokens are counted from the data, since a shard's
_stats.json describes only its last run (a resumed shard did part of its work before).
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.atomic import write_atomic
from batchgen.data.source import DEFAULT_ID_COLUMN
from batchgen.data.writer import JOB_FILE, STATS_FILE, SUCCESS_FILE
from batchgen.scaleout.shard import Shard

MERGED_FILE = "merged.parquet"


class MergeError(Exception):
    """The directory cannot be merged at all (no shards, not a directory)."""


class IncompleteOutput(MergeError):
    """Some shards are missing, unfinished or from another job; `problems` says which."""

    def __init__(self, out: str, problems: list[str], todo: list[int]) -> None:
        self.problems, self.todo = problems, todo
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(
            f"{out} is not ready to merge:\n{lines}\n"
            f"shards to (re)run: {','.join(map(str, todo)) or 'none'} (rerunning a shard resumes it)"
        )


class ShardState(str, enum.Enum):
    MISSING = "missing"  # no directory: never started
    RUNNING_OR_KILLED = "incomplete"  # a directory without _SUCCESS and no final stats
    INTERRUPTED = "interrupted"  # stopped by a signal or an error after writing its stats
    COMPLETE = "complete"


@dataclass(slots=True)
class ShardReport:
    shard: Shard
    state: ShardState
    path: Path
    parts: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # its _stats.json (last run)
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
        total = ("total", str(d["rows"]), str(d["rows_error"]), str(d["output_tokens"]),
                 f"{d['max_wall_s']:.2f}", f"{d['output_tokens_per_s']:.1f}", "(max wall)")  # fmt: skip
        widths = [max(len(r[i]) for r in [head, *rows, total]) for i in range(len(head))]

        def fmt(r):
            return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))  # fmt: skip

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
    stats = _read_json(path / STATS_FILE) or {}
    if (path / SUCCESS_FILE).exists():
        state = ShardState.COMPLETE
    elif stats.get("complete") is False:
        state = ShardState.INTERRUPTED
    else:
        state = ShardState.RUNNING_OR_KILLED
    parts = sorted(p.name for p in path.glob("part-*.parquet"))
    return ShardReport(shard, state, path, parts, stats, _read_json(path / JOB_FILE))


def check(reports: list[ShardReport]) -> list[str]:
    """Every reason the shards cannot be merged; empty when they can."""
    problems = []
    for r in reports:
        if r.state is ShardState.MISSING:
            problems.append(f"shard {r.shard}: missing (no {r.path.name}/ yet)")
        elif r.state is ShardState.INTERRUPTED:
            problems.append(
                f"shard {r.shard}: its last run stopped early (signal or error) after "
                f"{len(r.parts)} part file(s), no {SUCCESS_FILE} (unless a rerun is under way)"
            )
        elif r.state is ShardState.RUNNING_OR_KILLED:
            problems.append(
                f"shard {r.shard}: incomplete, {len(r.parts)} part file(s) and no {SUCCESS_FILE} "
                "(still running, or killed)"
            )
    jobs = [r for r in reports if r.fingerprint is not None]
    for r in jobs:
        if r.fingerprint.get("shard") != str(r.shard):
            problems.append(
                f"shard {r.shard}: its {JOB_FILE} is for shard {r.fingerprint.get('shard')}"
            )
    if jobs:
        ref = jobs[0]
        for r in jobs[1:]:
            diff = _differences(ref.fingerprint, r.fingerprint)
            if diff:
                problems.append(
                    f"shard {r.shard}: a different job from shard {ref.shard} ({'; '.join(diff)})"
                )
    for r in reports:
        if r.state is not ShardState.MISSING and r.fingerprint is None:
            problems.append(f"shard {r.shard}: no readable {JOB_FILE}")
    return problems


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    # output is where the shards are, by definition; shard is what tells them apart
    keys = sorted((set(a) | set(b)) - {"shard", "output"})
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def merge(out: str | os.PathLike[str], write_data: bool = True) -> MergeSummary:
    """Check OUT's shards and, if all are complete and agree, merge them (see module doc)."""
    root = Path(out)
    reports = scan(root)
    (root / SUCCESS_FILE).unlink(missing_ok=True)  # a new merge makes an old one stale
    problems = check(reports)
    if problems:
        todo = sorted({r.shard.index for r in reports if r.state is not ShardState.COMPLETE})
        raise IncompleteOutput(str(root), problems, todo)
    _check_row_count(reports)
    # The same durable atomic writes as the part files: complete or absent, fsynced, and
    # with the modes any new file gets.
    if write_data:
        write_atomic(root, MERGED_FILE, lambda f: _merge_parts(reports, f))
    else:
        _merge_parts(reports, None)
    summary = MergeSummary(root, reports, root / MERGED_FILE if write_data else None)
    write_atomic(root, STATS_FILE, lambda f: f.write(_json(summary.to_dict())))
    write_atomic(root, SUCCESS_FILE, lambda f: None)
    return summary


_COUNTED = ["error", "prompt_tokens", "completion_tokens"]


def _count(r: ShardReport, table: pa.Table) -> None:
    r.rows += table.num_rows
    r.rows_error += len(table.column("error")) - table.column("error").null_count
    r.prompt_tokens += pc.sum(table.column("prompt_tokens")).as_py() or 0
    completion = table.column("completion_tokens")
    if pa.types.is_list(completion.type):  # --n-as-list: a row's samples' counts
        completion = pc.list_flatten(completion)
    r.output_tokens += pc.sum(completion).as_py() or 0


def _check_row_count(reports: list[ShardReport]) -> None:
    """Complete shards of one job hold every input row; check the count where it is cheap."""
    fp = reports[0].fingerprint or {}
    try:
        from batchgen.data import InputError, open_input

        source = open_input(fp["input"])
    except (KeyError, InputError, OSError):
        return  # the input is elsewhere (another machine) or gone: nothing to compare with
    if source.num_rows is None:
        return  # JSON Lines are not counted without reading them
    if "n" in source.columns:
        return  # each row's own number of samples: not counted without reading them
    expected = source.num_rows if fp.get("limit") is None else min(fp["limit"], source.num_rows)
    if not fp.get("n_as_list"):
        expected *= fp.get("n", 1)  # a record per sample
    got = sum(pq.ParquetFile(r.path / p).metadata.num_rows for r in reports for p in r.parts)
    if got != expected:
        raise MergeError(
            f"the shards hold {got} rows but the input {fp['input']} has {expected}; "
            "did the input change while the shards ran? Rerun the job into a new output"
        )


def _merge_parts(reports: list[ShardReport], f: BinaryIO | None) -> None:
    """Count every shard's rows from its parts and, given a file, write them all into it as
    one Parquet file (shard 0's parts first)."""
    writer: pq.ParquetWriter | None = None
    try:
        for r in reports:
            for name in r.parts:
                part = r.path / name
                table = pq.read_table(part) if f else pq.read_table(part, columns=_COUNTED)
                _count(r, table)
                if f is None:
                    continue
                if writer is None:
                    writer = pq.ParquetWriter(f, table.schema)
                elif not table.schema.equals(writer.schema):
                    table = table.cast(writer.schema)
                writer.write_table(table)
        if f is not None and writer is None:  # no rows at all: an empty file of the id column
            id_column = (reports[0].fingerprint or {}).get("id_column") or DEFAULT_ID_COLUMN
            writer = pq.ParquetWriter(f, pa.schema([(id_column, pa.int64())]))
    finally:
        if writer is not None:
            writer.close()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _json(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n"
