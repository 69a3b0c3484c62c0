"""What an input is: a checked source of record batches, streamed in a stable order.

An `InputSource` (one subclass per format, reader.py) yields record batches without
materialising the input, re-cut to the requested size. Each batch comes with the global index of
its first row, so a row's number (its index in the whole input, the id of an input without an id
column) is the same on every run.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import pyarrow as pa

from batchgen.errors import InputError

# The input column of row ids by default, and the output's name for row numbers where there is none.
DEFAULT_ID_COLUMN = "id"


class InputFormat(str, enum.Enum):
    PARQUET = "parquet"
    JSONL = "jsonl"
    DATASETS = "datasets"
    OPENAI = "openai"  # OpenAI batch request lines (see openai_batch.py)


class InputBatch(NamedTuple):
    offset: int  # global row index of data's first row; the default id of row i is offset + i
    data: pa.RecordBatch


def default_ids(offset: int, num_rows: int) -> pa.Array:
    """The default ids of a batch: global row indices, stable across runs."""
    return pa.array(range(offset, offset + num_rows), type=pa.int64())


class InputSource:
    """An opened, checked input. Subclasses differ only in how they produce raw batches."""

    format: InputFormat

    files: list[str]  # every file the input reads, in reading order
    # A column whose non-null value makes its row an error. A source may add it to the batches
    # a job asks it for without holding it in its schema (JSON Lines: a malformed line's message).
    error_column: str | None = None

    def __init__(self, path: str, schema: pa.Schema, num_rows: int | None) -> None:
        self.path = path
        self.schema = schema.remove_metadata()
        names = self.schema.names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a column is found by its name: which one would be the prompt?
            raise InputError(
                f"input {path} has {len(names) - len(set(names))} duplicate column name(s): "
                f"{', '.join(map(repr, twice))}; give each column its own name"
            )
        self.num_rows = num_rows  # None where counting would mean reading everything (JSONL)

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    @property
    def id_column(self) -> str | None:
        """The id column without --id-column: one named `id`, if the input has it."""
        return DEFAULT_ID_COLUMN if DEFAULT_ID_COLUMN in self.schema.names else None

    def require_columns(self, names: Iterable[str], fixes: dict[str, str] | None = None) -> None:
        """fixes: {column: how to do without it}, added to the error where it is missing."""
        missing = [n for n in names if n not in self.schema.names and n != self.error_column]
        if missing:
            fix = "".join(f"; {fixes[n]}" for n in missing if fixes and n in fixes)
            raise InputError(
                f"input {self.path} has no column(s) {', '.join(map(repr, missing))}; "
                f"available columns: {', '.join(map(repr, self.columns))}{fix}"
            )

    def _field(self, name: str) -> pa.Field:
        if name == self.error_column and name not in self.schema.names:
            return pa.field(name, pa.string())
        return self.schema.field(name)

    def iter_batches(
        self, batch_rows: int, columns: Sequence[str] | None = None
    ) -> Iterator[InputBatch]:
        """Yield (offset, batch) in input order, from the first row.

        Every batch has exactly `batch_rows` rows except the last, and the schema
        `self.schema` (or its `columns` subset, in that order).
        """
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        schema = self.schema
        if columns is not None:
            self.require_columns(columns)
            schema = pa.schema([self._field(c) for c in columns])
        offset = 0
        raw = self._read(batch_rows, columns)
        for batch in _rebatch((_conform(b, schema) for b in raw), batch_rows):
            yield InputBatch(offset, batch)
            offset += batch.num_rows

    def _read(self, batch_rows: int, columns: Sequence[str] | None) -> Iterator[pa.RecordBatch]:
        """Raw batches of any size, in input order."""
        raise NotImplementedError


def _rebatch(batches: Iterable[pa.RecordBatch], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Re-cut a stream into batches of exactly batch_rows rows (the last may be shorter)."""
    pending: list[pa.RecordBatch] = []
    n = 0
    for batch in batches:
        start = 0
        while start < batch.num_rows:
            take = min(batch_rows - n, batch.num_rows - start)
            pending.append(batch.slice(start, take))
            n += take
            start += take
            if n == batch_rows:
                yield _concat(pending)
                pending, n = [], 0
    if n:
        yield _concat(pending)


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """The batch under the source's metadata-free schema (zero-copy), so batches always concat."""
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def decode_rows(batch: pa.RecordBatch, row_numbers: list[int]) -> tuple[list[dict], dict[int, str]]:
    """The batch's rows as dicts, and {position: error} for rows holding a string that is not
    valid UTF-8 (pyarrow's JSON reader passes such bytes through; decoding them fails).

    Those values become None and the row an error record, so that one bad line does not stop
    a job; the message names the row (its number in the input, 0-based: line N+1 of a JSON
    Lines file without blank lines)."""
    try:
        return batch.to_pylist(), {}
    except UnicodeDecodeError:
        pass  # find the rows, value by value
    records: list[dict] = []
    bad: dict[int, str] = {}
    for i in range(batch.num_rows):
        rec, cols = {}, []
        for name, column in zip(batch.schema.names, batch.columns, strict=True):
            try:
                rec[name] = column[i].as_py()
            except UnicodeDecodeError:
                rec[name] = None
                cols.append(repr(name))
        records.append(rec)
        if cols:
            bad[i] = (
                f"invalid UTF-8 in column {', '.join(cols)} of input row {row_numbers[i]}; "
                "fix the file's encoding (e.g. iconv -f <its encoding> -t utf-8)"
            )
    return records, bad
