"""JSON Lines inputs: pyarrow's block reader, and a line-by-line pass where it refuses a block.

pyarrow parses a file in blocks of JSON_BLOCK_BYTES and fails a whole block on one malformed
line (with a 0-based row number inside the block). A malformed line is not a failed job, as in
an OpenAI batch file: where a block fails, the rest of the file is read line by line, the good
lines still parsed by pyarrow (so their types are the same as the fast path's), and a bad line
becomes a row whose LINE_ERROR_COLUMN names its file and 1-based line number ("line 2"); that
row is an error record. The column is not part of the input's schema (it is no input column,
and no output copies it); it is added to the batches a job asks it for.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.json as pajson

from batchgen.data.source import InputFormat, InputSource
from batchgen.errors import InputError

# One JSON block is parsed at a time; its size bounds memory and the longest line pyarrow can read.
# Column types are inferred from each file's first block.
JSON_BLOCK_BYTES = 4 << 20
LINE_ERROR_COLUMN = "__batchgen_line_error"  # a malformed line's message, else null
_LINES_PER_CHUNK = 4096  # lines parsed at once where the block reader failed


class JsonlSource(InputSource):
    format = InputFormat.JSONL
    error_column = LINE_ERROR_COLUMN

    def __init__(self, path: str, files: list[str]) -> None:
        schemas = [s for s in (_jsonl_schema(f) for f in files) if s is not None]
        if not schemas:
            raise InputError(f"input {path} is empty: no JSON lines; pass a file with rows")
        try:
            schema = pa.unify_schemas(schemas, promote_options="permissive")
        except pa.ArrowException as e:
            raise InputError(
                f"JSON Lines files under {path} disagree on column types ({e}); "
                "make each column's type consistent, or convert the input to Parquet"
            ) from e
        # A column that is null in every sampled line is read as a string, the likeliest type.
        fields = [pa.field(f.name, pa.string()) if f.type == pa.null() else f for f in schema]
        super().__init__(path, pa.schema(fields), None)
        self.files = files

    def _read(self, batch_rows: int, columns: Sequence[str] | None) -> Iterator[pa.RecordBatch]:
        names = self.schema.names if columns is None else list(columns)
        for batch in (b for f in self.files for b in self._read_file(f)):
            yield batch.select(names)

    def _read_file(self, file: str) -> Iterator[pa.RecordBatch]:
        """The file's rows, each batch with LINE_ERROR_COLUMN last."""
        if is_blank(file):
            return
        # Every file is parsed with the unified schema, so all batches agree; fields absent from
        # the sampled first blocks (hence from .columns) are ignored.
        read = pajson.ReadOptions(block_size=JSON_BLOCK_BYTES)
        done = 0  # rows already given
        try:
            with pajson.open_json(file, read_options=read, parse_options=self._parse) as reader:
                for batch in reader:
                    yield _with_errors(batch, [None] * batch.num_rows)
                    done += batch.num_rows
            return
        except OSError as e:
            raise InputError(f"cannot read JSON Lines file {file}: {e}") from e
        except pa.ArrowException:
            pass  # a bad line: the rest line by line
        chunk: list[tuple[int, bytes]] = []
        for number, line in _lines(file, skip=done):
            chunk.append((number, line))
            if len(chunk) == _LINES_PER_CHUNK:
                yield self._parse_lines(file, chunk)
                chunk = []
        if chunk:
            yield self._parse_lines(file, chunk)

    @property
    def _parse(self) -> pajson.ParseOptions:
        return pajson.ParseOptions(explicit_schema=self.schema, unexpected_field_behavior="ignore")

    def _parse_lines(self, file: str, lines: list[tuple[int, bytes]]) -> pa.RecordBatch:
        """(1-based line number, line) -> one batch, a row per line: a bad line's row null but
        for its message."""
        errors: list[str | None] = [_line_error(line) for _, line in lines]
        good = [i for i, e in enumerate(errors) if e is None]
        try:
            table = self._parse_good([lines[i][1] for i in good])
        except pa.ArrowException:  # a value of another type than its column's: find the lines
            for i in good:
                try:
                    self._parse_good([lines[i][1]])
                except pa.ArrowException as e:
                    errors[i] = str(e).removeprefix("JSON parse error: ").split(" in row ")[0]
            good = [i for i, e in enumerate(errors) if e is None]
            table = self._parse_good([lines[i][1] for i in good])
        # the good rows, then one null row per bad line, put back in line order
        nulls = pa.Table.from_pylist([{}] * (len(lines) - len(good)), schema=self.schema)
        order = [0] * len(lines)
        for k, i in enumerate(good):
            order[i] = k
        bad = [i for i, e in enumerate(errors) if e is not None]
        for k, i in enumerate(bad):
            order[i] = len(good) + k
        rows = pa.concat_tables([table, nulls]).take(order).combine_chunks()
        messages = [
            None if e is None else f"JSON Lines file {file} line {n}: {e}"
            for (n, _), e in zip(lines, errors, strict=True)
        ]
        return _with_errors(rows.to_batches()[0] if rows.num_rows else _empty(self), messages)

    def _parse_good(self, lines: list[bytes]) -> pa.Table:
        if not lines:
            return self.schema.empty_table()
        return pajson.read_json(io.BytesIO(b"\n".join(lines)), parse_options=self._parse)


def _empty(source: JsonlSource) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=source.schema)


def _with_errors(batch: pa.RecordBatch, messages: list[str | None]) -> pa.RecordBatch:
    return batch.append_column(LINE_ERROR_COLUMN, pa.array(messages, pa.string()))


def _line_error(line: bytes) -> str | None:
    """Why a line is not one JSON object, or None."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:  # its own position: the line's is in the message
        return f"not valid JSON ({e.msg} at column {e.colno})"
    except ValueError as e:  # not UTF-8
        return f"not valid JSON ({e})"
    return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


def _lines(file: str, skip: int) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of the file's non-blank lines (pyarrow's rows), after the
    first `skip` of them."""
    with open(file, "rb") as fh:
        rows = 0
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rows += 1
            if rows > skip:
                yield number, line.rstrip(b"\r\n")


def _jsonl_schema(file: str) -> pa.Schema | None:
    """The schema pyarrow infers from the file's first block (its good lines, where some are
    malformed); None for an empty file."""
    if is_blank(file):
        return None
    with open(file, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"["):
        raise InputError(
            f"{file} holds a JSON array; batchgen reads JSON Lines (one object per line). "
            "Convert it, e.g. with: jq -c '.[]' in.json > in.jsonl"
        )
    read = pajson.ReadOptions(block_size=JSON_BLOCK_BYTES)
    try:
        with pajson.open_json(file, read_options=read) as reader:
            return reader.schema
    except OSError as e:
        raise InputError(f"cannot read JSON Lines file {file}: {e}") from e
    except pa.ArrowException:
        pass
    good, numbers, size, first_error = [], [], 0, None
    for number, line in _lines(file, skip=0):
        size += len(line)
        if size > JSON_BLOCK_BYTES:
            break
        error = _line_error(line)
        if error is None:
            good.append(line)
            numbers.append(number)
        first_error = first_error or (error and f"line {number}: {error}")
    if not good:
        raise InputError(
            f"cannot read JSON Lines file {file}: no line of its first {JSON_BLOCK_BYTES >> 20} "
            f"MiB is a JSON object ({first_error}); each line must be one JSON object"
        )
    data = b"\n".join(good)
    one_block = pajson.ReadOptions(block_size=len(data) + 1)  # row numbers: the good lines'
    try:
        return pajson.read_json(io.BytesIO(data), one_block).schema
    except pa.ArrowException as e:
        # "... in row K" (0-based, among the good lines) as the file's line
        where = re.sub(r" in row (\d+)", lambda m: f" on line {numbers[int(m[1])]}", str(e))
        raise InputError(
            f"cannot read JSON Lines file {file}: {where}; a column's type must not change "
            "between lines (or convert to Parquet)"
        ) from e


def is_blank(file: str) -> bool:
    """True for a file with nothing but whitespace (pyarrow refuses an empty JSON stream)."""
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True
