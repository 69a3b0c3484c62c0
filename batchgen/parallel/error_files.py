"""The other ranks' last error lines, in files rank 0 reads into its message about them.

Each rank-0 process keeps them in a directory of its own under the temp folder, named after
its pid, and removes it on `close`; a rank 0 that was killed (SIGKILL, a deadline's exit)
skips that, so a later one removes the directories whose pid is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

_DIR_PREFIX = "batchgen-ranks-"  # + rank 0's pid: the error files' directory


class ErrorFiles:
    """This rank 0's directory of error files, one per rank."""

    def __init__(self) -> None:
        _remove_stale_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-"))

    def path(self, rank: int) -> Path:
        """Where rank `rank` writes its error (follower.py's --error-file)."""
        return self.dir / f"rank-{rank}.error"

    def said(self, rank: int) -> str:
        """ " (its error)", or "" when the rank left none."""
        error = self.path(rank)
        return f" ({error.read_text().strip()})" if error.is_file() else ""

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove_stale_dirs() -> None:
    """The directories of rank-0 processes that are gone, and were ours."""
    for d in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        pid = d.name.removeprefix(_DIR_PREFIX).partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if d.stat().st_uid == os.getuid():
                shutil.rmtree(d)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
