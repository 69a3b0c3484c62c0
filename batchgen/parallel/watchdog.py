"""Rank 0's watchdog: times every wait on the other ranks and ends a rank that stops answering.

Rank 0 marks each wait on the ranks (a step, the load barrier, the rendezvous) with `waiting`;
a thread of ranks.py calls `watch`, which, while such a wait lasts, kills a rank seen stopped
(SIGSTOP) for `STOPPED_S`, and every rank once the wait has lasted `ANSWER_S`: their exit then
fails rank 0's wait, and `hung` says why each was ended. Both bounds are under the
collectives' own timeout (group.TIMEOUT).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

STOPPED_S = 10.0  # a rank stopped (SIGSTOP) this long while rank 0 waits on it is ended
ANSWER_S = 540.0  # any wait on the ranks (a step, compiles included) ends after this long
POLL_S = 0.2  # how often the watchdog looks


class Watchdog:
    """Watches ranks 1..N-1 (`procs`, rank r at index r-1) while rank 0 waits on them."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs  # the caller's list, filled as the ranks start
        self.hung: dict[int, str] = {}  # ranks the watchdog ended, and why
        self._waiting_since: float | None = None  # rank 0 waits on the ranks from then
        self._stopped: dict[int, float] = {}  # rank: since when it is seen stopped

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Rank 0 waits on the other ranks here: the watchdog times it."""
        self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self._waiting_since = None

    def watch(self, done: Callable[[], bool]) -> bool:
        """Look at the ranks every `POLL_S` until `done()` or a rank exits (True)."""
        while not done():
            if any(p.poll() is not None for p in self.procs):
                return True
            self._end_silent()
            time.sleep(POLL_S)
        return False

    def _end_silent(self) -> None:
        """While rank 0 waits on the ranks: kill those stopped for `STOPPED_S`, or all of
        them once the wait has lasted `ANSWER_S`."""
        began, now = self._waiting_since, time.monotonic()
        if began is None:
            self._stopped.clear()
            return
        for rank, proc in enumerate(self.procs, 1):
            if _state(proc.pid) == "T":
                if now - self._stopped.setdefault(rank, now) >= STOPPED_S:
                    self.hung[rank] = (
                        f"was stopped (SIGSTOP) and did not answer for {STOPPED_S:.0f} s"
                    )
            else:
                self._stopped.pop(rank, None)
        if not self.hung and now - began >= ANSWER_S:
            for rank in range(1, len(self.procs) + 1):
                self.hung[rank] = f"did not answer for {ANSWER_S:.0f} s"
        for rank in self.hung:
            with contextlib.suppress(OSError):
                self.procs[rank - 1].kill()


def _state(pid: int) -> str:
    """A process's state letter (R, S, T for stopped...), '' if unknown (or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]
