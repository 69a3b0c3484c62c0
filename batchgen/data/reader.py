"""Open and check a Parquet, JSONL, `datasets` or OpenAI batch input: one source per format.

`open_input` does every check that can fail on the input as a whole (path, format, a readable
footer or first block) so that a bad input is reported before a model is loaded; the source it
returns then streams the rows in batches (source.py).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.jsonl import JsonlSource, is_blank
from batchgen.data.openai_batch import OPENAI_ERROR_COLUMN, OpenAIBatchTable, is_openai_batch
from batchgen.data.source import InputFormat, InputSource
from batchgen.errors import InputError

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")
_SUPPORTED = (
    "a .parquet file, a .jsonl/.json (JSON Lines) file, a directory or glob of those, "
    "or a directory written by datasets' save_to_disk"
)


class ParquetSource(InputSource):
    format = InputFormat.PARQUET

    def __init__(self, path: str, files: list[str]) -> None:
        num_rows = 0
        schema: pa.Schema | None = None
        for f in files:
            if os.path.getsize(f) == 0:
                raise InputError(f"input {f} is empty (0 bytes); pass a Parquet file with rows")
            try:
                with pq.ParquetFile(f) as pf:
                    meta = pf.metadata
                    file_schema = pf.schema_arrow.remove_metadata()
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"cannot read Parquet file {f}: {e}") from e
            if schema is None:
                schema = file_schema
            elif not file_schema.equals(schema):
                raise InputError(
                    f"Parquet file {f} has a different schema from {files[0]}; "
                    f"all input files must share one schema.\n{f}:\n{file_schema}\n"
                    f"{files[0]}:\n{schema}"
                )
            num_rows += meta.num_rows
        assert schema is not None  # _resolve never returns an empty file list
        super().__init__(path, schema, num_rows)
        self.files = files

    def _read(self, batch_rows: int, columns: Sequence[str] | None) -> Iterator[pa.RecordBatch]:
        for f in self.files:
            try:
                with pq.ParquetFile(f) as pf:
                    yield from pf.iter_batches(batch_rows, columns=columns)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"cannot read Parquet file {f}: {e}") from e


class DatasetsSource(InputSource):
    format = InputFormat.DATASETS

    def __init__(self, path: str) -> None:
        import datasets  # slow to import; only needed for this format

        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:  # datasets raises a variety of types for a broken directory
            raise InputError(f"cannot load datasets directory {path}: {e}") from e
        if not isinstance(ds, datasets.Dataset):
            raise InputError(f"{path} is not a single datasets.Dataset; pass one split directory")
        # save_to_disk flattens any indices mapping, so the memory-mapped table is in row order.
        self._table: pa.Table = ds.data.table
        super().__init__(path, self._table.schema, self._table.num_rows)
        # The directory's files (arrow data, state.json), for the job's input fingerprint.
        self.files = sorted(
            os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
        )

    def _read(self, batch_rows: int, columns: Sequence[str] | None) -> Iterator[pa.RecordBatch]:
        table = self._table if columns is None else self._table.select(list(columns))
        yield from table.to_batches(max_chunksize=batch_rows)


class OpenAIBatchSource(InputSource):
    """OpenAI batch request files, parsed whole when opened (openai_batch.py)."""

    format = InputFormat.OPENAI
    error_column = OPENAI_ERROR_COLUMN

    @property
    def id_column(self) -> str:
        return "custom_id"

    def __init__(self, path: str, files: list[str]) -> None:
        parsed = OpenAIBatchTable(files)
        table = parsed.table
        # absent when no line sets it: a plain job, no samples, no top alternatives
        for name in ("n", "json_schema", "top_logprobs"):
            if table.column(name).null_count == table.num_rows:
                table = table.drop_columns([name])
        self._table = table
        self.unsupported_fields = dict(sorted(parsed.unsupported_fields.items()))
        super().__init__(path, self._table.schema, self._table.num_rows)
        self.files = files

    @property
    def asks_logprobs(self) -> bool:
        """Does any line ask for its tokens' logprobs?"""
        return bool(pc.any(self._table.column("logprobs")).as_py())

    @property
    def requests(self) -> pa.Table:
        """Every line's custom_id, messages (null for a completion), whether it asked for
        logprobs, its body's model, whether it is an embeddings line and that line's
        dimensions and encoding_format, in input order."""
        names = ["custom_id", "messages", "logprobs", "model", "embeddings"]
        return self._table.select([*names, "dimensions", "encoding_format"])

    def _read(self, batch_rows: int, columns: Sequence[str] | None) -> Iterator[pa.RecordBatch]:
        table = self._table if columns is None else self._table.select(list(columns))
        yield from table.to_batches(max_chunksize=batch_rows)


def open_input(path: str | os.PathLike[str]) -> InputSource:
    """Open and check an input; raises InputError naming the problem and the fix."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise InputError(
                f"{path} is a datasets DatasetDict with splits {splits}; pass one split, "
                f"e.g. {os.path.join(path, splits[0] if splits else 'train')}"
            )
        if any(os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_info.json")):
            return DatasetsSource(path)
    fmt, files = _resolve(path)
    if fmt is InputFormat.PARQUET:
        return ParquetSource(path, files)
    openai = [is_openai_batch(f) for f in files if not is_blank(f)]
    if openai and all(openai):
        return OpenAIBatchSource(path, files)
    if any(openai):
        raise InputError(
            f"{path} mixes OpenAI batch request files and other JSON Lines files; "
            "pass one kind at a time"
        )
    return JsonlSource(path, files)


def _resolve(path: str) -> tuple[InputFormat, list[str]]:
    """The format and the sorted file list of a file, directory or glob input."""
    if glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise InputError(f"no files match {path!r}; check the pattern (quote it in the shell)")
    elif os.path.isdir(path):
        # Hidden and _-prefixed names are bookkeeping (e.g. _SUCCESS, .crc), not data.
        files = sorted(
            os.path.join(path, n)
            for n in os.listdir(path)
            if not n.startswith((".", "_"))
            and n.endswith(PARQUET_SUFFIXES + JSONL_SUFFIXES)
            and os.path.isfile(os.path.join(path, n))
        )
        if not files:
            raise InputError(
                f"directory {path} has no .parquet or .jsonl files directly inside; "
                f"pass a glob such as '{os.path.join(path, '**', '*.parquet')}' or one of "
                f"{_SUPPORTED}"
            )
    elif os.path.isfile(path):
        files = [path]
    else:
        raise InputError(f"input {path} does not exist; pass {_SUPPORTED}")

    formats = {_format_of(f) for f in files}
    if len(formats) > 1:
        raise InputError(f"{path} mixes Parquet and JSON Lines files; pass one format at a time")
    return formats.pop(), files


def _format_of(file: str) -> InputFormat:
    if file.endswith(PARQUET_SUFFIXES):
        return InputFormat.PARQUET
    if file.endswith(JSONL_SUFFIXES):
        return InputFormat.JSONL
    raise InputError(f"unsupported input format: {file}; pass {_SUPPORTED}")
