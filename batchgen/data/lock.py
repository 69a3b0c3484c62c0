"""One writer per output directory: an exclusive flock on `OUT/.batchgen/_lock`, held for the
writer's lifetime; a second run fails at once naming the holder's pid. The lock file is opened
without following a symbolic link, and only a regular file is taken: a link planted as the lock
file must not get its target truncated (or created)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import IO

from batchgen.data.atomic import os_error
from batchgen.errors import InputError, OutputBusy

LOCK_FILE = "_lock"


def lock_directory(directory: str) -> IO[str]:
    """Take the directory's exclusive lock, or fail naming the run that holds it.

    flock belongs to the open file, so the lock lasts exactly as long as the returned file
    stays open, and a killed process never leaves a stale lock. The file itself is kept."""
    path = os.path.join(directory, LOCK_FILE)
    not_a_file = InputError(
        f"{path} is not a regular file (a link, directory or device); batchgen "
        "keeps its lock there: remove it, or pick another output directory"
    )
    # O_NONBLOCK: a FIFO planted there must not hang the open; it is refused just below.
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise not_a_file from None
        raise InputError(os_error(e, f"cannot write to output {directory}")) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # a hard link's target is not ours
        os.close(fd)
        raise not_a_file
    f = os.fdopen(fd, "a+")  # held open for the OutputDir's lifetime
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


def lock_holder(directory: str | os.PathLike[str]) -> str | None:
    """The pid a live run wrote into directory's lock file ("unknown" if none), or None when
    no run holds the lock. Asks with a shared flock, let go at once."""
    path = os.path.join(os.fspath(directory), LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "unknown"
    return None  # closing the file let the shared lock go
