"""Merge a sharded output: check that every shard finished, then combine data and statistics.

A sharded job (`batchgen run --shard I/N`, `batchgen slurm`, `batchgen run --workers`) leaves

    OUT/shard-00000-of-00003/   an ordinary output directory (parts, and .batchgen/ with
    OUT/shard-00001-of-00003/   job.json, stats.json, SUCCESS) per shard
    OUT/shard-00002-of-00003/

and `merge(OUT)` adds, all under hidden names so that directory readers (pd.read_parquet(OUT),
load_dataset(data_dir=OUT)) still read each row once, from the shards:

    OUT/.batchgen/merged.pq  every shard's rows in one Parquet file (shard 0's parts first, then
                         shard 1's, ...: grouped by shard, not in input order), same columns as
                         the parts (the id column under its input name, as in job.json's id_column)
    OUT/.batchgen/stats.json  totals, throughput and a per-shard table; latency percentiles,
                         MFU and MBU over all shards (merge_metrics.py)
    OUT/.batchgen/steps.pq  every shard's step timeline on one clock, for `batchgen report`
    OUT/.batchgen/verdict.json  with max_error_rate (`--workers`, `merge --max-error-rate`):
                         the job's error-rate verdict over every shard's rows (data/verdict.py)
    OUT/.batchgen/SUCCESS  written last

Shards and merges of batchgen 0.1 (_SUCCESS, _stats.json, merged.parquet ... at the top) are moved
into this layout first.

Nothing is merged unless every shard 0..N-1 has its SUCCESS, all shards agree on N, and their
job.json fingerprints agree (apart from the shard itself); otherwise `IncompleteOutput` names
the shards by number. Row counts, errors and tokens are counted from the data, since a shard's
stats.json describes only its last run (a resumed shard did part of its work before).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.atomic import TMP_PREFIX
from batchgen.data.layout import check_meta_dir, holds_unsharded_run
from batchgen.data.source import DEFAULT_ID_COLUMN
from batchgen.data.verdict import record_verdict
from batchgen.data.writer import (
    JOB_FILE,
    MERGED_FILE,
    META_DIR,
    STATS_FILE,
    STEPS_FILE,
    SUCCESS_FILE,
    VERDICT_FILE,
    migrate_old_layout,
    write_file,
)
from batchgen.errors import InputError, MergeError
from batchgen.runner.split import shard_counts
from batchgen.scaleout.merge_metrics import job_rates, merge_steps, merged_metrics
from batchgen.scaleout.shard_report import (
    IncompleteOutput,
    MergeSummary,
    ShardReport,
    ShardState,
    scan,
)

# write_atomic's temp names of a merge's files: left behind by a merge killed mid-write.
_MERGE_FILES = (MERGED_FILE, STATS_FILE, SUCCESS_FILE, "merged.parquet", "_stats.json", "_SUCCESS")
_MERGE_FILES += (STEPS_FILE,)
_TEMP_NAMES = "|".join(re.escape(Path(f).name) for f in _MERGE_FILES)  # today's and 0.1's
_TMP_RE = re.compile(rf"{re.escape(TMP_PREFIX)}({_TEMP_NAMES})\.\w+")


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


def merge(
    out: str | os.PathLike[str], write_data: bool = True, max_error_rate: float | None = None
) -> MergeSummary:
    """Check OUT's shards and, if all are complete and agree, merge them (see module doc);
    with max_error_rate, the job's verdict over every shard's rows (summary.verdict), judged
    once here rather than by each shard on its own."""
    root = Path(out)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "no such directory"
        raise InputError(f"{root}: {what}; pass the output directory of a sharded job")
    check_meta_dir(root)  # merge writes there: never through a link
    if holds_unsharded_run(root) and shard_counts(root):  # before anything in it moves
        raise MergeError(
            f"{root} holds the results of a run without --shard beside shard folders: two jobs "
            "(a reader of the directory sees both); move one of them to another directory"
        )
    _migrate_old_layout(root)
    reports = scan(root)
    for stale in (SUCCESS_FILE, VERDICT_FILE):  # a new merge makes an old one's stale
        (root / stale).unlink(missing_ok=True)
    _remove_temp_files(root)
    problems = check(reports)
    if problems:
        todo = sorted({r.shard.index for r in reports if r.state is not ShardState.COMPLETE})
        raise IncompleteOutput(str(root), problems, todo)
    _check_row_count(reports)
    # The same durable atomic writes as the part files: complete or absent, fsynced, and
    # with the modes any new file gets.
    if write_data:
        write_file(root, MERGED_FILE, lambda f: _merge_parts(reports, f))
    else:
        _merge_parts(reports, None)
    summary = JobSummary(root, reports, root / MERGED_FILE if write_data else None)
    stats = {**summary.to_dict(), **merged_metrics(reports)}
    merge_steps(reports, root)
    write_file(root, STATS_FILE, lambda f: f.write(_json(stats)))
    if max_error_rate is not None:  # recorded before SUCCESS, as a run does
        parts = [str(r.path / p) for r in reports for p in r.parts]
        summary.verdict = record_verdict(root, parts, max_error_rate)
    write_file(root, SUCCESS_FILE, lambda f: None)
    return summary


class JobSummary(MergeSummary):
    """MergeSummary with the job's rates over the union of the shards' run intervals (not
    the slowest shard's wall: shards run one after the other took their sum)."""

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), **job_rates(self.shards, self.rows, self.output_tokens)}

    def table(self) -> str:
        lines = super().table().split("\n")
        d = self.to_dict()
        i = next(n for n, line in enumerate(lines) if line.startswith("total"))
        widths = [len(w) for w in lines[i - 1].split("  ")]  # the rule above the total
        cells = ["total", str(d["rows"]), str(d["rows_error"]), str(d["output_tokens"])]
        cells += [f"{d['wall_s']:.2f}", f"{d['output_tokens_per_s']:.1f}", "(union)"]
        lines[i] = "  ".join(
            c.rjust(w) if n else c.ljust(w)
            for n, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "\n".join(lines)


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
        from batchgen.data import open_input
        from batchgen.errors import InputError

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


def _remove_temp_files(root: Path) -> None:
    for folder in (root, root / META_DIR):
        for p in folder.iterdir() if folder.is_dir() else ():
            if _TMP_RE.fullmatch(p.name) and p.is_file():
                p.unlink()


def _migrate_old_layout(root: Path) -> None:
    """Move batchgen 0.1's files, in the merge and in each complete shard (one still running
    keeps its files until it is opened again), into today's layout."""
    if not root.is_dir() or not shard_counts(root):
        return  # scan() says what is wrong, before anything in a folder not ours moves
    for shard in root.glob("shard-*-of-*"):
        if (shard / "_SUCCESS").exists() or (shard / SUCCESS_FILE).exists():
            migrate_old_layout(shard)
    migrate_old_layout(root)
    if (root / "merged.parquet").exists():
        (root / "merged.parquet").replace(root / MERGED_FILE)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n"
