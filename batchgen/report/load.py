"""What a report is drawn from: an output directory's stats and step timeline, of one
run or of merged shards (`batchgen merge` writes both for the whole job).

Both describe the directory's last run, and stats.json is written when a run ends while the
timeline grows at each flush: a report made while a run writes the directory (its lock is
held) shows the previous run's table beside the running one's steps, and a resumed job's
figures leave out the rows earlier runs did. `notes` says so, on the page and in the log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.data.lock import lock_holder
from batchgen.data.writer import JOB_FILE, META_DIR, STATS_FILE, migrate_old_layout
from batchgen.errors import InputError
from batchgen.report.outcomes import Outcomes, read_outcomes
from batchgen.stats.steps import read_steps, steps_files


@dataclass(slots=True)
class RunData:
    out: Path
    stats: dict[str, Any]
    steps: dict[str, np.ndarray] | None  # the timeline's columns (stats/steps.py); None: none
    notes: list[str]  # what the figures do not cover (a running or resumed job)
    job: dict[str, Any] | None = None  # job.json: the command's options (a merge's: shard 0's)
    outcomes: Outcomes | None = None  # finish reasons and errors, from the part files

    @property
    def merged(self) -> bool:
        return "per_shard" in self.stats


def load(out: str | Path) -> RunData:
    """OUT's statistics and timeline; InputError naming the fix when there are none."""
    root = Path(out)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "no such directory"
        raise InputError(f"{root}: {what}; pass a batchgen output directory")
    migrate_old_layout(root)  # an older batchgen's output: its report goes beside the rest
    path = root / STATS_FILE
    writer = lock_holder(root / META_DIR)
    if not path.exists():
        if writer is not None:
            raise InputError(
                f"{path} not found: a batchgen run (pid {writer}) is writing {root} now and "
                "writes its statistics when it ends; report then"
            )
        raise InputError(f"{path} not found: {_no_stats_fix(root)}")
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if not isinstance(stats, dict):
        raise InputError(
            f"{path} holds a JSON {type(stats).__name__}, not the object of statistics batchgen "
            "writes; run the job again to write it anew"
        )
    try:
        table = read_steps(root)
    except (pa.ArrowException, OSError) as e:
        files = ", ".join(map(str, steps_files(root)))
        raise InputError(
            f"cannot read the step timeline {files}: {e}; delete it for a report "
            "without the timeline, or run the job again"
        ) from None
    # numpy columns: the plots bin millions of steps without a Python object per value
    steps = None if table is None else {n: table.column(n).to_numpy() for n in table.column_names}
    job = _job(root)
    outcomes = read_outcomes(root, (job or {}).get("id_column"))
    return RunData(root, stats, steps, _notes(stats, writer), job, outcomes)


def _job(root: Path) -> dict[str, Any] | None:
    """OUT's job.json, or the first shard's for a merge; None where unreadable."""
    for path in (root / JOB_FILE, *sorted(root.glob(f"shard-*-of-*/{JOB_FILE}"))[:1]):
        try:
            job = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return job if isinstance(job, dict) else None
    return None


def _notes(stats: dict[str, Any], writer: str | None) -> list[str]:
    if writer is not None:
        return [
            f"a batchgen run (pid {writer}) is writing this output now: the table is the "
            "previous run's, the plots are the running one's steps so far; report again when "
            "it ends"
        ]
    done = stats.get("rows_skipped_done") or 0
    if done and "per_shard" not in stats:
        return [
            f"this output was resumed: the table and the plots cover its last run only "
            f"({done} rows were done by earlier runs and are not in their figures)"
        ]
    return []


def _no_stats_fix(root: Path) -> str:
    """What a directory without statistics is, and what to do."""
    if sorted(root.glob("shard-*-of-*")):
        return f"{root} holds shards: run `batchgen merge {root}` first"
    if (root / JOB_FILE).exists() or sorted(root.glob("part-*.parquet")):
        return (
            f"{root} holds an unfinished run (stopped before it wrote its statistics, e.g. "
            "killed): run the same `batchgen run` command again to finish it, then report"
        )
    return f"{root} is not a batchgen output (run `batchgen run ... -o OUT` into it first)"
