"""Which input columns a job's output copies, and under which names.

By default the output copies every input column besides the id column. An input column named
like one of the output's own columns (`generated_text`, `error`, a score job's `label` or
`scores`) is not
lost: it is copied as `input_<name>` (prefixed again until the name is free), and one warning
names it. `--passthrough` lists the columns to copy under their own names, and a list naming an
output column is refused (records.output_schema).
"""

from __future__ import annotations

import logging

from batchgen.data import InputFormat, InputSource
from batchgen.data.pooled_columns import CLASSIFY_COLUMNS, EMBED_COLUMNS, REWARD_COLUMNS
from batchgen.data.records import LEGACY_TEXT_COLUMN, TEXT_COLUMN, reserved_columns
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
    pooled = {Task.EMBED: EMBED_COLUMNS, Task.CLASSIFY: CLASSIFY_COLUMNS + REWARD_COLUMNS}
    score, lps = cfg.task is Task.SCORE, cfg.task is Task.PROMPT_LOGPROBS
    reserved = reserved_columns(score, lps, pooled.get(cfg.task, ()))
    return _names(cfg, source, id_column, reserved)


def legacy_renames(cfg: RunConfig, source: InputSource, id_column: str | None) -> dict[str, str]:
    """{name in a part written before `text` became `generated_text`: name today}: the text
    column, and input columns whose copy was prefixed then because `text` was taken."""
    if cfg.task is not Task.GENERATE:
        return {}
    reserved = reserved_columns()
    before = _names(cfg, source, id_column, reserved | {LEGACY_TEXT_COLUMN}, warn=False)
    now = _names(cfg, source, id_column, reserved, warn=False)
    moved = {before[c]: now[c] for c in now if before[c] != now[c]}
    return {LEGACY_TEXT_COLUMN: TEXT_COLUMN, **moved}


def _names(
    cfg: RunConfig,
    source: InputSource,
    id_column: str | None,
    reserved: frozenset[str],
    warn: bool = True,
) -> dict[str, str]:
    if cfg.passthrough is not None:
        return {c: c for c in cfg.passthrough if c != id_column}
    if source.format is InputFormat.OPENAI:
        return {c: c for c in OPENAI_PASSTHROUGH if c in source.columns}
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
    if renamed and warn:
        log.warning(
            "input column(s) copied to the output under another name, as the output has "
            "columns of theirs: %s",
            ", ".join(renamed),
        )
    return names
