"""What a report is drawn from: an output directory's stats and step timeline, of one
run or of merged shards (`batchgen merge` writes both for the whole job)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchgen.data.writer import STATS_FILE, STEPS_FILE, migrate_old_layout
from batchgen.errors import InputError


@dataclass(slots=True)
class RunData:
    out: Path
    stats: dict[str, Any]
    steps: dict[str, list] | None  # STEPS_FILE's columns; None: no timeline

    @property
    def merged(self) -> bool:
        return "per_shard" in self.stats


def load(out: str | Path) -> RunData:
    """OUT's statistics and timeline; InputError naming the fix when there are none."""
    root = Path(out)
    if root.is_dir():
        migrate_old_layout(root)  # an older batchgen's output: its report goes beside the rest
    path = root / STATS_FILE
    if not path.exists():
        shards = sorted(root.glob("shard-*-of-*")) if root.is_dir() else []
        fix = (
            f"it holds shards: run `batchgen merge {root}` first"
            if shards
            else "run `batchgen run ... -o OUT` into it first"
        )
        raise InputError(f"{path} not found: {root} is not a batchgen output ({fix})")
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    steps_path = root / STEPS_FILE
    steps = pq.read_table(steps_path).to_pydict() if steps_path.exists() else None
    return RunData(root, stats, steps)
