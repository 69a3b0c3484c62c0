"""Result records: the output schema, a row's record (its input side, `Row`, and its result,
the engine's completion), and the buffer that checks records against the schema and hands
the output directory a part's worth at a time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from batchgen.data import prompt_logprob_columns as prompt_lp
from batchgen.data.pooled_columns import PooledColumns
from batchgen.data.source import DEFAULT_ID_COLUMN
from batchgen.data.writer import OutputDir
from batchgen.errors import InputError

# A generated row's text, named as Ray Data LLM names it: an input's usual `text` column keeps
# its name beside it. batchgen before 0.5 wrote it as `text` (LEGACY_TEXT_COLUMN).
TEXT_COLUMN = "generated_text"
LEGACY_TEXT_COLUMN = "text"
_OUTPUT_COLUMNS = (TEXT_COLUMN, "finish_reason", "prompt_tokens", "completion_tokens", "error")
# Names an input column cannot keep in the output: the result row already has them. The id
# column keeps its input name (`id` for row numbers), so it is reserved only for the passthrough.
# --with-timings: each row's seconds (stats/latency.py says what they are)
TIMING_COLUMNS = ("queued_s", "ttft_s", "latency_s", "tpot_s")
_RESULT_FIELDS = ("sample_index", "token_ids", "logprobs", "top_logprobs", "stop_reason")
RESERVED_COLUMNS = frozenset({*_OUTPUT_COLUMNS, *_RESULT_FIELDS, *TIMING_COLUMNS})
# A generated token's likeliest alternatives, best first (rows that ask: a top_logprobs column).
TOP_LOGPROBS_TYPE = pa.list_(pa.list_(pa.struct([("id", pa.int32()), ("logprob", pa.float32())])))
SCORE_COLUMNS = frozenset({"label", "scores"})  # a score job's results, in place of text


@dataclass(slots=True)
class Row:
    """The input side of one output record: what the row was, before the engine ran it."""

    id: Any
    passthrough: dict[str, Any]
    prompt_tokens: int = 0
    error: str | None = None
    sample_index: int | None = None  # which of the row's n samples (None: a job without n)
    num_samples: int = 1  # the row's n
    labels: tuple[str, ...] = ()  # task score: the labels its request scores, in order


class Result(Protocol):
    """What a record takes from a row's result (the engine's Completion)."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    scores: list[float] | None
    pooled: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    error: str | None
    stop_reason: str | int | None

    @property
    def finish_reason(self) -> Any: ...  # an enum whose value is the column's text

    @property
    def completion_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RecordShape:
    """The columns of a job's result records besides its passthrough: one definition for the
    schema (`schema`) and for each record (`record`)."""

    id_column: str = DEFAULT_ID_COLUMN
    score: bool = False  # the labels' probabilities (`label`, `scores`) in place of the text
    prompt_logprobs: int | None = None  # the prompt's logprobs, k alternatives each (no text)
    pooled: PooledColumns | None = None  # task embed's embedding, classify's label (no text)
    samples: bool = False  # a record per sample, keyed by (id, sample_index)
    as_list: bool = False  # a record per row, its samples' fields as lists
    with_token_ids: bool = False
    with_logprobs: bool = False
    with_timings: bool = False
    with_top_logprobs: bool = False
    with_stop_reason: bool = False

    def schema(self, id_type: pa.DataType, passthrough: pa.Schema) -> pa.Schema:
        return output_schema(
            id_type,
            passthrough,
            self.with_token_ids,
            self.with_logprobs,
            samples=self.samples,
            id_column=self.id_column,
            score=self.score,
            prompt_logprobs=self.prompt_logprobs,
            pooled=self.pooled,
            as_list=self.as_list,
            with_timings=self.with_timings,
            with_top_logprobs=self.with_top_logprobs,
            with_stop_reason=self.with_stop_reason,
        )

    def record(
        self, row: Row, result: Result | None, timings: dict[str, float | None] | None = None
    ) -> dict[str, Any]:
        """The record of a row: its result, or its error (result None, or finish_reason
        error). A result may carry a note in `error` and keep its text: a constrained row cut
        at max_new_tokens. timings: its TIMING_COLUMNS, kept with with_timings (None: nulls)."""
        ok = result is not None and result.finish_reason.value != "error"
        rec = {self.id_column: row.id, **row.passthrough}
        if row.sample_index is not None:
            rec["sample_index"] = row.sample_index
        if self.score:  # the labels' probabilities, normalised over them
            probs = normalise(result.scores) if ok else None
            rec["label"] = row.labels[probs.index(max(probs))] if ok else None
            rec["scores"] = list(zip(row.labels, probs, strict=True)) if ok else None
        elif self.prompt_logprobs is not None:
            rec.update(prompt_lp.record_fields(result if ok else None, self.prompt_logprobs))
        elif self.pooled is not None:
            rec.update(self.pooled.record_fields(result.pooled if ok else None))
        else:
            rec[TEXT_COLUMN] = result.text if ok else None
        rec.update(
            finish_reason=result.finish_reason.value if ok else "error",
            prompt_tokens=row.prompt_tokens,
            completion_tokens=result.completion_tokens if ok else 0,
            error=result.error if result is not None else row.error,
        )
        if self.with_token_ids:
            rec["token_ids"] = result.token_ids if ok else None
        if self.with_logprobs:
            rec["logprobs"] = result.logprobs if ok else None
        if self.with_timings:
            rec.update(timings or dict.fromkeys(TIMING_COLUMNS))
        if self.with_top_logprobs:
            top = result.top_logprobs if ok else None
            rec["top_logprobs"] = top and [[{"id": i, "logprob": v} for i, v in t] for t in top]
        if self.with_stop_reason:  # a stop token id as its decimal text: one column type
            reason = result.stop_reason if ok else None
            rec["stop_reason"] = None if reason is None else str(reason)
        return rec


def normalise(logprobs: list[float]) -> list[float]:
    """log P(label | prompt) per label -> P(label | prompt, one of the labels)."""
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def reserved_columns(
    score: bool = False, prompt_logprobs: bool = False, pooled: tuple[str, ...] = ()
) -> frozenset[str]:
    """Output columns of a job (besides its id): an input column cannot keep their names."""
    if pooled:
        return (RESERVED_COLUMNS - {TEXT_COLUMN}) | set(pooled)
    if prompt_logprobs:
        return (RESERVED_COLUMNS - {TEXT_COLUMN}) | set(prompt_lp.COLUMNS)
    return (RESERVED_COLUMNS - {TEXT_COLUMN}) | SCORE_COLUMNS if score else RESERVED_COLUMNS


def output_schema(
    id_type: pa.DataType,
    passthrough: pa.Schema,
    with_token_ids: bool = False,
    with_logprobs: bool = False,
    samples: bool = False,
    id_column: str = DEFAULT_ID_COLUMN,
    score: bool = False,
    as_list: bool = False,
    with_timings: bool = False,
    with_top_logprobs: bool = False,
    with_stop_reason: bool = False,
    prompt_logprobs: int | None = None,
    pooled: PooledColumns | None = None,
) -> pa.Schema:
    """The one definition of a result row: the id under its input column's name (and
    sample_index, for n samples a row), passthrough input columns, generation fields (a
    score job: the most likely label and each label's probability, in place of text; a
    prompt-logprobs job (prompt_logprobs: its alternatives per token) its prompt's logprobs).
    as_list: a row's n samples in one record, their generation fields as lists."""
    reserved = reserved_columns(score, prompt_logprobs is not None, pooled.names if pooled else ())
    if id_column in reserved:
        raise InputError(
            f"id column {id_column!r} has the name of an output column, and the output keeps "
            "the id column's name; rename it in the input"
        )
    clash = [n for n in passthrough.names if n in reserved or n == id_column]
    if clash:
        raise InputError(
            f"passthrough column(s) {', '.join(map(repr, clash))} clash with output columns "
            f"{sorted({id_column, *reserved})}; leave them out of the passthrough list"
        )
    result = (
        [pa.field("label", pa.string()), pa.field("scores", pa.map_(pa.string(), pa.float64()))]
        if score
        else [pa.field(TEXT_COLUMN, pa.string())]
    )
    if prompt_logprobs is not None:
        result = prompt_lp.schema_fields(prompt_logprobs > 0, TOP_LOGPROBS_TYPE)
    if pooled is not None:
        result = pooled.fields()
    fields = [
        pa.field(id_column, id_type),
        *([pa.field("sample_index", pa.int32())] if samples and not as_list else []),
        *passthrough.remove_metadata(),
        *result,
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("error", pa.string()),
    ]
    if with_token_ids:
        fields.append(pa.field("token_ids", pa.list_(pa.int32())))
    if with_logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.float32())))
    if with_timings:
        fields += [pa.field(c, pa.float64()) for c in TIMING_COLUMNS]
    if with_top_logprobs:
        fields.append(pa.field("top_logprobs", TOP_LOGPROBS_TYPE))
    if with_stop_reason:
        fields.append(pa.field("stop_reason", pa.string()))
    if as_list:
        fields = [
            pa.field(f.name, pa.list_(f.type)) if f.name in LIST_FIELDS else f for f in fields
        ]
    return pa.schema(fields)


# A sample's own fields: gathered into lists (in sample order) by SampleLists.
LIST_FIELDS = (
    TEXT_COLUMN,
    "finish_reason",
    "completion_tokens",
    "token_ids",
    "logprobs",
    *TIMING_COLUMNS,
    "top_logprobs",
    "stop_reason",
)


class PartBuffer:
    """Collects result rows and writes a part every `rows_per_part` rows.

    Rows are dicts with exactly the schema's fields; the explicit schema keeps every part's
    types the same even when a part's column is all null.
    """

    def __init__(
        self,
        output: OutputDir,
        rows_per_part: int,
        schema: pa.Schema,
        write: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        """write: takes each part's rows instead of writing them at once (the run hands them
        to its writer thread, runner/sink.py)."""
        if rows_per_part < 1:
            raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
        self.output = output
        self.rows_per_part = rows_per_part
        self.schema = schema
        self._names = set(schema.names)
        self._rows: list[dict[str, Any]] = []
        self._write = write or self.write_part
        self._parts = 0  # parts handed to _write

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            if row.keys() != self._names:
                missing, extra = self._names - row.keys(), row.keys() - self._names
                raise ValueError(
                    f"result row does not match the output schema: "
                    f"missing {sorted(missing)}, unexpected {sorted(extra)}"
                )
            self._rows.append(row)
        while len(self._rows) >= self.rows_per_part:
            self._write(self._rows[: self.rows_per_part])
            self._parts += 1
            self._rows = self._rows[self.rows_per_part :]

    def flush(self, final: bool = False) -> None:
        """Write the rows held. final: the job is complete; an output that would have no part
        (no rows at all) gets one empty part, so readers see the schema, not a frame without
        columns."""
        if self._rows or (final and not self._parts and not self.output.part_files()):
            self._write(self._rows)
            self._parts += 1
            self._rows = []

    def write_part(self, rows: list[dict[str, Any]]) -> None:
        """Write rows as the output's next part."""
        self.output.write_part(pa.Table.from_pylist(rows, schema=self.schema))
