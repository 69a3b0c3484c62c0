"""Streaming output with resume: a directory of atomically written Parquet parts.

Layout of an output directory:
    _lock                held (flock) by the one run writing the directory; holds its pid
    _job.json            the job's fingerprint (input, model, options, and what the model
                         and input files were when it started); written first
    part-00000.parquet   results, each part written to a temp name, fsynced, then renamed
    part-00001.parquet   ...
    _stats.json          run statistics (throughput, timings, memory); the leading
                         underscore makes Parquet readers skip it, like _SUCCESS
    _SUCCESS             written last, once every row has a result

Exactly-once: a part either exists complete under its final name or not at all, so the ids in
the parts are exactly the rows already done. A rerun of the same job reads those ids, skips
them and numbers its new parts after the existing ones. A part that cannot be read is deleted
with the directory's _SUCCESS, so its rows are redone before the job counts as complete again.

One writer at a time: opening takes an exclusive flock on _lock for the OutputDir's lifetime and
fails at once, naming the holder's pid, while another run has it. Only under that lock are the
temp files of a killed run deleted, and only once the directory is known to be batchgen's.
"""

from __future__ import annotations

import errno
import fcntl
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

from batchgen.data.errors import InputError, OutputBusy, OutputError
from batchgen.data.reader import DEFAULT_ID_COLUMN

log = logging.getLogger(__name__)

JOB_FILE = "_job.json"
STATS_FILE = "_stats.json"
SUCCESS_FILE = "_SUCCESS"
LOCK_FILE = "_lock"
RESULTS_FILE = "results.jsonl"  # OpenAI batch output lines (--output-format openai)
TMP_PREFIX = ".tmp-"
_PART_RE = re.compile(r"part-(\d+)\.parquet")
# What write_atomic's mkstemp names look like: TMP_PREFIX, the final name, "." and a random tail.
# Any other ".tmp-..." entry is not ours, so it is neither deleted nor taken as a sign of ownership.
_TMP_RE = re.compile(
    r"\.tmp-(part-\d+\.parquet|_job\.json|_stats\.json|_SUCCESS|results\.jsonl)\.\w+"
)
WriteFn = Callable[[BinaryIO], None]
_OUTPUT_COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")
# Names an input column cannot keep in the output: the result row already has them. The id
# column keeps its input name (`id` for row numbers), so it is reserved only for the passthrough.
RESERVED_COLUMNS = frozenset({"sample_index", *_OUTPUT_COLUMNS, "token_ids", "logprobs"})


def output_schema(
    id_type: pa.DataType,
    passthrough: pa.Schema,
    with_token_ids: bool = False,
    with_logprobs: bool = False,
    samples: bool = False,
    id_column: str = DEFAULT_ID_COLUMN,
) -> pa.Schema:
    """The one definition of a result row: the id under its input column's name (and
    sample_index, for n samples a row), passthrough input columns, generation fields."""
    if id_column in RESERVED_COLUMNS:
        raise InputError(
            f"id column {id_column!r} has the name of an output column, and the output keeps "
            "the id column's name; rename it in the input"
        )
    clash = [n for n in passthrough.names if n in RESERVED_COLUMNS or n == id_column]
    if clash:
        raise InputError(
            f"passthrough column(s) {', '.join(map(repr, clash))} clash with output columns "
            f"{sorted({id_column, *RESERVED_COLUMNS})}; leave them out of the passthrough list"
        )
    fields = [
        pa.field(id_column, id_type),
        *([pa.field("sample_index", pa.int32())] if samples else []),
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
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise InputError(_os_error(e, f"cannot create output {self.path}")) from None
        # Read-only first: nothing, not even the lock file, goes into a directory that is not ours.
        self._check_owner()
        self._lock = _lock(self.path)
        try:
            self._claim(overwrite)
            self._remove_temp_files()
        except BaseException:
            self.close()
            raise
        self._next_part = max(self._part_numbers(), default=-1) + 1

    def close(self) -> None:
        """Release the directory's lock (closing the file drops the flock)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_complete(self) -> bool:
        return os.path.exists(os.path.join(self.path, SUCCESS_FILE))

    def part_files(self) -> list[str]:
        return [_part_name(n) for n in sorted(self._part_numbers())]

    def done_ids(self, id_column: str = DEFAULT_ID_COLUMN) -> set[Any]:
        """Ids of rows with a result ((id, sample_index) pairs in a job with n samples), read
        from each part's `id_column`. A part that cannot be read is deleted and its rows
        redone; one without that column is refused (its ids are under another name)."""
        done: set[Any] = set()
        for name in self.part_files():
            file = os.path.join(self.path, name)
            try:
                names = pq.read_schema(file).names
                if id_column not in names:
                    raise InputError(
                        f"output part {file} has no id column {id_column!r}, so its rows cannot "
                        "be matched to the input (written by an older batchgen, which named "
                        "every id column `id`?); pass --overwrite to redo the job, or pick "
                        "another output directory"
                    )
                samples = "sample_index" in names
                table = pq.read_table(file, columns=[id_column, "sample_index"][: 1 + samples])
            except (pa.ArrowException, OSError) as e:
                log.warning(
                    "deleting unreadable output part %s (its rows will be redone): %s", file, e
                )
                os.remove(file)
                # The job is not complete until those rows are done again.
                self._unmark_success()
                continue
            ids = table.column(id_column).to_pylist()
            done.update(zip(ids, table.column("sample_index").to_pylist(), strict=True) if samples else ids)  # fmt: skip
        return done

    def write_part(self, table: pa.Table) -> str:
        """Write the next part atomically; returns its file name."""
        name = _part_name(self._next_part)
        write_atomic(self.path, name, lambda f: pq.write_table(table, f))
        self._next_part += 1
        return name

    def write_stats(self, stats: dict[str, Any]) -> None:
        write_atomic(self.path, STATS_FILE, _json_writer(stats))

    def mark_success(self) -> None:
        write_atomic(self.path, SUCCESS_FILE, lambda f: None)

    def _unmark_success(self) -> None:
        success = os.path.join(self.path, SUCCESS_FILE)
        if os.path.exists(success):
            log.warning(
                "removing %s: the job is complete again once those rows are redone", success
            )
            os.remove(success)

    def read_all(self) -> pa.Table:
        """Every part concatenated in part order (the OpenAI results file is built from it)."""
        tables = [pq.read_table(os.path.join(self.path, n)) for n in self.part_files()]
        return pa.concat_tables(tables) if tables else pa.table({})

    def _check_owner(self) -> None:
        """Refuse a directory that holds files batchgen did not write and no _job.json."""
        names = os.listdir(self.path)
        if JOB_FILE in names:
            return  # ours; other files in it (notes, logs/) are left alone
        foreign = [n for n in names if not _is_ours(n)]
        if foreign:
            shown = ", ".join(sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
            raise InputError(
                f"output {self.path} is not empty and was not written by batchgen ({shown}); "
                "pick an empty or new output directory"
            )

    def _claim(self, overwrite: bool) -> None:
        """Make the directory this job's: refuse another job's results unless overwriting.

        A directory with another job's _job.json but no part files is taken over: nothing is
        lost, and a job that failed before writing anything (e.g. a refused pickle checkpoint)
        can be rerun with the fix into the same output."""
        job_file = os.path.join(self.path, JOB_FILE)
        names = [n for n in os.listdir(self.path) if n != LOCK_FILE]
        if os.path.exists(job_file):
            try:
                with open(job_file) as f:
                    stored = json.load(f)
            except (OSError, ValueError):
                stored = None  # unreadable: treated like another job's
            if stored == self.fingerprint and not overwrite:
                return
            if not overwrite and self._part_numbers():
                changed = _changed_keys(stored, self.fingerprint)
                raise InputError(
                    f"output {self.path} holds another job's results (its {JOB_FILE} differs"
                    f"{' in ' + ', '.join(changed) if changed else ''}); pass --overwrite to "
                    "replace them, or pick another output directory"
                )
            if not overwrite:
                log.warning(
                    "output %s holds no results of its earlier job; taking it over", self.path
                )
        elif any(_is_ours(n) for n in names) and not overwrite:
            raise InputError(
                f"output {self.path} holds result files without a {JOB_FILE}; "
                "pass --overwrite to replace them, or pick another output directory"
            )
        for n in names:
            if _is_ours(n):
                _remove(os.path.join(self.path, n))
        write_atomic(self.path, JOB_FILE, _json_writer(self.fingerprint))

    def _part_numbers(self) -> list[int]:
        return [int(m.group(1)) for n in os.listdir(self.path) if (m := _PART_RE.fullmatch(n))]

    def _remove_temp_files(self) -> None:
        for n in os.listdir(self.path):
            if _TMP_RE.fullmatch(n):
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
        name in (JOB_FILE, STATS_FILE, SUCCESS_FILE, LOCK_FILE, RESULTS_FILE)
        or _TMP_RE.fullmatch(name) is not None
        or _PART_RE.fullmatch(name) is not None
    )


def _changed_keys(stored: Any, current: dict[str, Any]) -> list[str]:
    if not isinstance(stored, dict):
        return []
    return sorted(k for k in set(stored) | set(current) if stored.get(k) != current.get(k))


def _lock(directory: str):
    """Take the directory's exclusive lock, or fail naming the run that holds it.

    flock belongs to the open file, so the lock lasts exactly as long as the returned file
    stays open, and a killed process never leaves a stale lock. The file itself is kept."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        f = open(path, "a+")  # noqa: SIM115 - held open for the OutputDir's lifetime
    except OSError as e:
        raise InputError(_os_error(e, f"cannot write to output {directory}")) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise OutputBusy(
            f"output {directory} is in use by another batchgen run (pid {holder}); wait for it "
            "to finish, or pick another output directory"
        ) from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _os_error(e: OSError, what: str) -> str:
    """One line for a failed file operation, with the fix for the usual causes."""
    fixes = {
        errno.ENOSPC: "free some space (or pick another output directory), then run the same "
        "command again to resume",
        errno.EDQUOT: "free some space under your quota, then run the same command again to resume",
        errno.EACCES: "pick a directory you can write to",
        errno.EPERM: "pick a directory you can write to",
        errno.EROFS: "the file system is read-only; pick another output directory",
        errno.ENOTDIR: "a part of the path is a file; pick another output directory",
    }
    fix = fixes.get(
        e.errno, "check the output directory's storage, then run the same command again"
    )
    return f"{what}: {e.strerror or e}; {fix}"


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


def write_atomic(directory: str | os.PathLike[str], name: str, write: WriteFn) -> None:
    """Write `name` in `directory` so that it appears complete or not at all, durably (file and
    directory entry fsynced), with the mode any new file would get. Every file batchgen leaves
    in an output, parts and merged results alike, is written this way.

    A failure (a full disk, say) removes the temp file and raises OutputError."""
    directory = os.fspath(directory)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{name}.", dir=directory)
    except OSError as e:
        raise OutputError(_os_error(e, f"cannot write {name} in {directory}")) from e
    try:
        # mkstemp makes the file owner-only; results get the modes any new file would.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
        # The rename itself is durable only once the directory entry is synced.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OutputError(_os_error(e, f"cannot write {name} in {directory}")) from e
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
