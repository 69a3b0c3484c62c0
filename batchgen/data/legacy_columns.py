"""Part files of an output written before the text column's rename (`text`, now
`generated_text`): a rerun rewrites them under today's names, so one output never holds two
schemas. Before the rename an input `text` column was copied as `input_text`; the caller says
which names moved (job/passthrough.py `legacy_renames`)."""

from __future__ import annotations

import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.atomic import write_atomic
from batchgen.data.records import LEGACY_TEXT_COLUMN, TEXT_COLUMN
from batchgen.data.writer import OutputDir

log = logging.getLogger(__name__)


def is_legacy(names: list[str]) -> bool:
    """A generate job's part written before the rename: `text` and no `generated_text` (a score
    job has neither, and its `text` is an input column)."""
    return LEGACY_TEXT_COLUMN in names and TEXT_COLUMN not in names and "scores" not in names


def rename_legacy_parts(out: OutputDir, renames: dict[str, str]) -> int:
    """Rewrite, atomically, each part of `out` written before the rename with its columns
    renamed ({old: new}, applied at once); the number rewritten."""
    rewritten = 0
    for name in out.part_files():
        path = os.path.join(out.path, name)
        try:
            if not is_legacy(pq.read_schema(path).names):
                continue
        except (pa.ArrowException, OSError):  # unreadable: OutputDir.done_ids redoes its rows
            continue
        table = pq.read_table(path)
        table = table.rename_columns([renames.get(c, c) for c in table.column_names])
        write_atomic(out.path, name, lambda f, t=table: _write(t, f))
        rewritten += 1
    if rewritten:
        log.warning(
            "output %s: %d part file(s) of an earlier batchgen rewritten with today's column "
            "names (%s)",
            out.path,
            rewritten,
            ", ".join(f"{a} -> {b}" for a, b in renames.items()),
        )
    return rewritten


def _write(table: pa.Table, f) -> None:
    pq.write_table(table, f)
