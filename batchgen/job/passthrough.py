"""Which input columns a job's output copies, and under which names.

By default the output copies every input column besides the id column. An input column named
like one of the output's own columns (`text`, `error`, a score job's `label` or `scores`) is not
lost: it is copied as `input_<name>` (prefixed again until the name is free), and one warning
names it. `--passthrough` lists the columns to copy under their own names, and a list naming an
output column is refused (records.output_schema).
"""

from __future__ import annotations

import logging

from batchgen.data import InputFormat, InputSource
from batchgen.data.records import reserved_columns
from batchgen.data.source import DEFAULT_ID_COLUMN
from batchgen.job.config import RunConfig, Task

log = logging.getLogger(__name__)

# Columns of an OpenAI batch file copied to the output by default (the request's prompt).
OPENAI_PASSTHROUGH = ("prompt", "messages")
RENAME_PREFIX = "input_"


def passthrough_columns(
    cfg: RunConfig, source: InputSource, id_column: str | None
) -> dict[str, str]:
    """{input column: its name in the output}, in input order, without the id column."""
    if cfg.passthrough is not None:
        return {c: c for c in cfg.passthrough if c != id_column}
    if source.format is InputFormat.OPENAI:
        return {c: c for c in OPENAI_PASSTHROUGH if c in source.columns}
    reserved = reserved_columns(score=cfg.task is Task.SCORE)
    taken = {*source.columns, *reserved, id_column or DEFAULT_ID_COLUMN}
    names: dict[str, str] = {}
    renamed: list[str] = []
    for c in source.columns:
        if c == id_column:
            continue
        name = c
        if c in reserved:
            while name in taken:
                name = RENAME_PREFIX + name
            taken.add(name)
            renamed.append(f"{c!r} as {name!r}")
        names[c] = name
    if renamed:
        log.warning(
            "input column(s) copied to the output under another name, as the output has "
            "columns of theirs: %s",
            ", ".join(renamed),
        )
    return names
