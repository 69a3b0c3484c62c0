"""Streaming output with resume: a directory of atomically written Parquet parts.

The output directory's layout (the part files are the dataset; everything else under hidden
names) is in layout.py, and its names are re-exported here.

Exactly-once: a part either exists complete under its final name or not at all, so the ids in
the parts are exactly the rows already done. A rerun of the same job reads those ids, skips
them and numbers its new parts after the existing ones. A part that cannot be read is deleted
with the directory's SUCCESS_FILE, so its rows are redone before the job counts as complete
again.

One writer at a time: opening takes an exclusive flock on LOCK_PATH for the OutputDir's
lifetime and fails at once, naming the holder's pid, while another run has it. Only under that
lock are the temp files of a killed run deleted, and only once the directory is known to be
batchgen's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.atomic import WriteFn, os_error, write_atomic
from batchgen.data.layout import (
    JOB_FILE,
    LOCK_PATH,
    MERGED_FILE,
    META_DIR,
    PART_RE,
    REPORT_FILE,
    RESULTS_FILE,
    STATS_FILE,
    STEPS_FILE,
    SUCCESS_FILE,
    TMP_RE,
    VERDICT_FILE,
    check_meta_dir,
    is_ours,
    migrate_old_layout,
    part_name,
    write_file,
)
from batchgen.data.lock import LOCK_FILE, lock_directory
from batchgen.data.source import DEFAULT_ID_COLUMN
from batchgen.data.verdict import ErrorVerdict, record_verdict
from batchgen.errors import InputError

log = logging.getLogger(__name__)

__all__ = [
    "JOB_FILE",
    "LOCK_PATH",
    "MERGED_FILE",
    "META_DIR",
    "REPORT_FILE",
    "RESULTS_FILE",
    "STATS_FILE",
    "STEPS_FILE",
    "SUCCESS_FILE",
    "VERDICT_FILE",
    "OutputDir",
    "migrate_old_layout",
    "write_file",
]


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
        if os.path.islink(self.path) and not os.path.exists(self.path):
            raise InputError(
                f"output {self.path} links to {os.readlink(self.path)}, which does not exist; "
                "create it or pass another -o"
            )
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise InputError(os_error(e, f"cannot create output {self.path}")) from None
        # Read-only first: nothing, not even the lock file, goes into a directory that is not ours.
        check_meta_dir(self.path)
        self._check_owner()
        migrate_old_layout(self.path)
        meta = os.path.join(self.path, META_DIR)
        try:
            os.makedirs(meta, exist_ok=True)
        except OSError as e:
            raise InputError(os_error(e, f"cannot create output {self.path}")) from None
        self._lock = lock_directory(meta)
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
        return [part_name(n) for n in sorted(self._part_numbers())]

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
            done.update(
                zip(ids, table.column("sample_index").to_pylist(), strict=True) if samples else ids
            )
        return done

    def write_part(self, table: pa.Table) -> str:
        """Write the next part atomically; returns its file name."""
        name = part_name(self._next_part)
        write_atomic(self.path, name, lambda f: pq.write_table(table, f))
        self._next_part += 1
        return name

    def write_stats(self, stats: dict[str, Any]) -> None:
        write_file(self.path, STATS_FILE, _json_writer(stats))

    def record_verdict(self, max_error_rate: float) -> ErrorVerdict:
        """The error-rate verdict on every row in the parts, written beside SUCCESS."""
        parts = [os.path.join(self.path, n) for n in self.part_files()]
        return record_verdict(self.path, parts, max_error_rate)

    def mark_success(self) -> None:
        write_file(self.path, SUCCESS_FILE, lambda f: None)

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
        """Refuse a directory that holds files batchgen did not write and no JOB_FILE (nor
        0.1's _job.json)."""
        names = os.listdir(self.path)
        if os.path.exists(os.path.join(self.path, JOB_FILE)) or "_job.json" in names:
            return  # ours; other files in it (notes, logs/) are left alone
        foreign = [n for n in names if not is_ours(n)]
        if foreign:
            shown = ", ".join(sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
            raise InputError(
                f"output {self.path} is not empty and was not written by batchgen ({shown}); "
                "pick an empty or new output directory"
            )

    def _claim(self, overwrite: bool) -> None:
        """Make the directory this job's: refuse another job's results unless overwriting.

        A directory with another job's JOB_FILE but no part files is taken over: nothing is
        lost, and a job that failed before writing anything (e.g. a refused pickle checkpoint)
        can be rerun with the fix into the same output."""
        job_file = os.path.join(self.path, JOB_FILE)
        names = self._bookkeeping_and_parts()
        if os.path.exists(job_file):
            try:
                with open(job_file) as f:
                    stored = json.load(f)
            except (OSError, ValueError):
                stored = None  # unreadable: treated like another job's
            if stored == self.fingerprint and not overwrite:
                return
            if not overwrite and _changed_keys(stored, self.fingerprint) == ["limit"]:
                self._change_limit(stored)
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
        elif names and not overwrite:
            raise InputError(
                f"output {self.path} holds result files without a {JOB_FILE}; "
                "pass --overwrite to replace them, or pick another output directory"
            )
        for n in names:
            _remove(os.path.join(self.path, n))
        write_file(self.path, JOB_FILE, _json_writer(self.fingerprint))

    def _change_limit(self, stored: dict[str, Any]) -> None:
        """The same job under another limit (None: all rows): a larger one continues it, a
        smaller one finds a complete job complete and refuses to cut an unfinished one short."""
        old, new = stored.get("limit"), self.fingerprint.get("limit")
        if new is None or (old is not None and new >= old):
            log.warning("output %s: limit %s -> %s; continuing the job", self.path, old, new)
            if self.is_complete:
                os.remove(os.path.join(self.path, SUCCESS_FILE))
            write_file(self.path, JOB_FILE, _json_writer(self.fingerprint))
        elif self.is_complete:
            self.fingerprint = stored
        else:
            raise InputError(
                f"output {self.path} holds an unfinished job with limit {old}; rerun it with "
                f"--limit {old} or more (or no limit) to resume, or pass --overwrite"
            )

    def _part_numbers(self) -> list[int]:
        return [int(m.group(1)) for n in os.listdir(self.path) if (m := PART_RE.fullmatch(n))]

    def _bookkeeping_and_parts(self) -> list[str]:
        """Every file of ours in the directory but the lock, as paths relative to it."""
        top = [n for n in os.listdir(self.path) if n != META_DIR and is_ours(n)]
        meta = os.listdir(os.path.join(self.path, META_DIR))
        return top + [f"{META_DIR}/{n}" for n in meta if n != LOCK_FILE]

    def _remove_temp_files(self) -> None:
        for folder in (self.path, os.path.join(self.path, META_DIR)):
            for n in os.listdir(folder):
                if TMP_RE.fullmatch(n):
                    log.warning("removing leftover temp file %s from an interrupted run", n)
                    _remove(os.path.join(folder, n))


def _changed_keys(stored: Any, current: dict[str, Any]) -> list[str]:
    if not isinstance(stored, dict):
        return []
    return sorted(k for k in set(stored) | set(current) if stored.get(k) != current.get(k))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _json_writer(obj: Any) -> WriteFn:
    def write(f: BinaryIO) -> None:
        f.write(json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n")

    return write
