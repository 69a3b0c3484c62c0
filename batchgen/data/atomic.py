"""Durable atomic file writes (`write_atomic`), and one-line messages for failed file operations."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from batchgen.errors import OutputError

TMP_PREFIX = ".tmp-"
WriteFn = Callable[[BinaryIO], None]


def os_error(e: OSError, what: str) -> str:
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
        raise OutputError(os_error(e, f"cannot write {name} in {directory}")) from e
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
        raise OutputError(os_error(e, f"cannot write {name} in {directory}")) from e
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
