"""One writer per output directory: an exclusive flock on `OUT/_lock`, held for the writer's
lifetime; a second run fails at once naming the holder's pid."""

from __future__ import annotations

import fcntl
import os
from typing import IO

from batchgen.data.atomic import os_error
from batchgen.errors import InputError, OutputBusy

LOCK_FILE = "_lock"


def lock_directory(directory: str) -> IO[str]:
    """Take the directory's exclusive lock, or fail naming the run that holds it.

    flock belongs to the open file, so the lock lasts exactly as long as the returned file
    stays open, and a killed process never leaves a stale lock. The file itself is kept."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        f = open(path, "a+")  # noqa: SIM115 - held open for the OutputDir's lifetime
    except OSError as e:
        raise InputError(os_error(e, f"cannot write to output {directory}")) from None
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
