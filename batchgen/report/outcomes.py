"""How the rows ended, counted from the output's part files: finish reasons ("stop",
"length", "error", ...) and the error rows grouped by reason (numbers as N, as stats.json's
`error_reasons` groups them) with a few examples each, so that the page says why rows failed.

Only the `finish_reason`, `error` and id columns are read. The part files hold every run's
rows (a resumed job's earlier rows too), and a merged job's are its shards' parts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.layout import PART_RE

EXAMPLES = 3  # example rows shown per error reason


@dataclass(slots=True)
class Outcomes:
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # reason (numbers as N) -> (rows, up to EXAMPLES (id, error text) pairs)
    errors: dict[str, tuple[int, list[tuple[str, str]]]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(self.finish_reasons.values())


def part_files(root: Path) -> list[Path]:
    """The run's part files, or a merged job's shards' parts."""
    own = sorted(p for p in root.glob("part-*.parquet") if PART_RE.fullmatch(p.name))
    if own:
        return own
    return sorted(
        p
        for shard in sorted(root.glob("shard-*-of-*"))
        for p in shard.glob("part-*.parquet")
        if PART_RE.fullmatch(p.name)
    )


def read_outcomes(root: Path, id_column: str | None) -> Outcomes | None:
    """The rows' outcomes; None where there are no part files or none has the columns."""
    out = Outcomes()
    found = False
    for path in part_files(root):
        try:
            names = pq.ParquetFile(path).schema_arrow.names
            if "finish_reason" not in names:
                continue
            cols = [c for c in ("finish_reason", "error", id_column or "id") if c in names]
            table = pq.read_table(path, columns=cols)
        except (pa.ArrowException, OSError):
            continue  # a part being written or foreign: the stats table still has the counts
        found = True
        _count(out, table, id_column or "id")
    return out if found else None


def _count(out: Outcomes, table: pa.Table, id_column: str) -> None:
    reasons = table.column("finish_reason").to_pylist()
    for r in reasons:
        key = "none" if r is None else str(r)
        out.finish_reasons[key] = out.finish_reasons.get(key, 0) + 1
    if "error" not in table.column_names:
        return
    errors = table.column("error").to_pylist()
    ids = table.column(id_column).to_pylist() if id_column in table.column_names else None
    for i, (reason, text) in enumerate(zip(reasons, errors, strict=True)):
        if reason != "error" or text is None:
            continue
        group = re.sub(r"\d+(\.\d+)?", "N", str(text))[:200]
        n, examples = out.errors.get(group, (0, []))
        if len(examples) < EXAMPLES:
            examples.append(("-" if ids is None else str(ids[i]), str(text)[:300]))
        out.errors[group] = (n + 1, examples)
