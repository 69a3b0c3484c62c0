"""Streaming output with resume: a directory of atomically written Parquet parts.

Layout of an output directory:
    _job.json            the job's fingerprint (input, model, options); written first
    part-00000.parquet   results, each part written to a temp name, fsynced, then renamed
    part-00001.parquet   ...
    _stats.json          run statistics (throughput, timings, memory); the leading
                         underscore makes Parquet readers skip it, like _SUCCESS
    _SUCCESS             written last, once every row has a result

Exactly-once: a part either exists complete under its final name or not at all, so the ids in
the parts are exactly the rows already done. A rerun of the same job reads those ids, skips
them and numbers its new parts after the existing ones. Temp files of a killed run are deleted
on open, so one process writes a given directory at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.errors import InputError

log = logging.getLogger(__name__)

JOB_FILE = "_job.json"
STATS_FILE = "_stats.json"
SUCCESS_FILE = "_SUCCESS"
TMP_PREFIX = ".tmp-"
_PART_RE = re.compile(r"part-(\d+)\.parquet")
WriteFn = Callable[[BinaryIO], None]
_OUTPUT_COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")
# Names an input column cannot keep in the output: the result row already has them.
RESERVED_COLUMNS = frozenset({"id", *_OUTPUT_COLUMNS, "token_ids", "logprobs"})


def output_schema(
    id_type: pa.DataType,
    passthrough: pa.Schema,
    with_token_ids: bool = False,
    with_logprobs: bool = False,
) -> pa.Schema:
    """The one definition of a result row: id, passthrough input columns, generation fields."""
    clash = [n for n in passthrough.names if n in RESERVED_COLUMNS]
    if clash:
        raise InputError(
            f"passthrough column(s) {', '.join(map(repr, clash))} clash with output columns "
            f"{sorted(RESERVED_COLUMNS)}; leave them out of the passthrough list"
        )
    fields = [
        pa.field("id", id_type),
        *passthrough.remove_metadata(),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("error", pa.string()),
    ]
    if with_token_ids:
        fields.append(pa.field("token_ids", pa.list_(pa.int32())))
    if with_logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.float32())))
    return pa.schema(fields)


class OutputDir:
    """An output directory opened for one job; see the module docstring for the layout."""

    def __init__(
        self, path: str | os.PathLike[str], fingerprint: dict[str, Any], overwrite: bool = False
    ) -> None:
        self.path = os.fspath(path)
        # Round-trip so tuples and lists (and key order) compare equal to what was stored.
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise InputError(f"output {self.path} is a file; pass a directory path")
        os.makedirs(self.path, exist_ok=True)
        self._remove_temp_files()
        self._claim(overwrite)
        self._next_part = max(self._part_numbers(), default=-1) + 1

    @property
    def is_complete(self) -> bool:
        return os.path.exists(os.path.join(self.path, SUCCESS_FILE))

    def part_files(self) -> list[str]:
        return [_part_name(n) for n in sorted(self._part_numbers())]

    def done_ids(self) -> set[Any]:
        """Ids of rows with a result. A part that cannot be read is deleted and its rows redone."""
        done: set[Any] = set()
        for name in self.part_files():
            file = os.path.join(self.path, name)
            try:
                ids = pq.read_table(file, columns=["id"]).column("id")
            except (pa.ArrowException, OSError, KeyError) as e:
                log.warning(
                    "deleting unreadable output part %s (its rows will be redone): %s", file, e
                )
                os.remove(file)
                continue
            done.update(ids.to_pylist())
        return done

    def write_part(self, table: pa.Table) -> str:
        """Write the next part atomically; returns its file name."""
        name = _part_name(self._next_part)
        _write_atomic(self.path, name, lambda f: pq.write_table(table, f))
        self._next_part += 1
        return name

    def write_stats(self, stats: dict[str, Any]) -> None:
        _write_atomic(self.path, STATS_FILE, _json_writer(stats))

    def mark_success(self) -> None:
        _write_atomic(self.path, SUCCESS_FILE, lambda f: None)

    def read_all(self) -> pa.Table:
        """Every part concatenated in part order (for tests and merging)."""
        tables = [pq.read_table(os.path.join(self.path, n)) for n in self.part_files()]
        return pa.concat_tables(tables) if tables else pa.table({})

    def _claim(self, overwrite: bool) -> None:
        """Make the directory this job's: refuse another job's results unless overwriting."""
        job_file = os.path.join(self.path, JOB_FILE)
        names = os.listdir(self.path)
        foreign = [n for n in names if not _is_ours(n)]
        if os.path.exists(job_file):
            try:
                with open(job_file) as f:
                    stored = json.load(f)
            except (OSError, ValueError):
                stored = None  # unreadable: treated like another job's
            if stored == self.fingerprint and not overwrite:
                return
            if not overwrite:
                raise InputError(
                    f"output {self.path} holds another job's results (its {JOB_FILE} differs); "
                    "pass --overwrite to replace them, or pick another output directory"
                )
        elif foreign:
            # Not ours (no _job.json): never write into, or delete from, someone else's directory.
            shown = ", ".join(sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
            raise InputError(
                f"output {self.path} is not empty and was not written by batchgen ({shown}); "
                "pick an empty or new output directory"
            )
        elif any(_is_ours(n) for n in names) and not overwrite:
            raise InputError(
                f"output {self.path} holds result files without a {JOB_FILE}; "
                "pass --overwrite to replace them, or pick another output directory"
            )
        if overwrite:
            for n in names:
                if _is_ours(n):
                    _remove(os.path.join(self.path, n))
        _write_atomic(self.path, JOB_FILE, _json_writer(self.fingerprint))

    def _part_numbers(self) -> list[int]:
        return [int(m.group(1)) for n in os.listdir(self.path) if (m := _PART_RE.fullmatch(n))]

    def _remove_temp_files(self) -> None:
        for n in os.listdir(self.path):
            if n.startswith(TMP_PREFIX):
                log.warning("removing leftover temp file %s from an interrupted run", n)
                _remove(os.path.join(self.path, n))


class PartBuffer:
    """Collects result rows and writes a part every `rows_per_part` rows.

    Rows are dicts with exactly the schema's fields; the explicit schema keeps every part's
    types the same even when a part's column is all null.
    """

    def __init__(self, output: OutputDir, rows_per_part: int, schema: pa.Schema) -> None:
        if rows_per_part < 1:
            raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
        self.output = output
        self.rows_per_part = rows_per_part
        self.schema = schema
        self._names = set(schema.names)
        self._rows: list[dict[str, Any]] = []

    @property
    def pending(self) -> int:
        return len(self._rows)

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
            self._rows = self._rows[self.rows_per_part :]

    def flush(self) -> None:
        if self._rows:
            self._write(self._rows)
            self._rows = []

    def _write(self, rows: list[dict[str, Any]]) -> None:
        self.output.write_part(pa.Table.from_pylist(rows, schema=self.schema))


def _part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


def _is_ours(name: str) -> bool:
    return (
        name in (JOB_FILE, STATS_FILE, SUCCESS_FILE)
        or name.startswith(TMP_PREFIX)
        or _PART_RE.fullmatch(name) is not None
    )


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _json_writer(obj: Any) -> WriteFn:
    def write(f: BinaryIO) -> None:
        f.write(json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n")

    return write


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def _write_atomic(directory: str, name: str, write: WriteFn) -> None:
    """Write `name` in `directory` so that it appears complete or not at all."""
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{name}.", dir=directory)
    try:
        # mkstemp makes the file owner-only; results get the modes any new file would.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # The rename itself is durable only once the directory entry is synced.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
