"""Exit within seconds of a stop signal or a fatal error, whatever the main thread is doing.

A SIGTERM/SIGINT during a run is a flag that the run loop checks between engine steps, so the
finished rows are flushed and marked before it exits. A step can be long (a large allocation, a
big prefill, a window of many rows being prepared), and Python runs a signal's handler only
between bytecodes of the main thread, so the loop may not look for minutes. So the signal also
wakes a watchdog thread, through `signal.set_wakeup_fd` (which the C-level handler writes at
once, while the main thread is still inside its call): if the run has not ended
`SIGNAL_GRACE_S` later, the process exits with 128 + the signal (143 for SIGTERM), as a SIGKILL
would end it. That loses nothing: parts are written atomically and the next run resumes.

After a fatal error the run's cleanup (flushing, closing the model's ranks) gets
`FATAL_GRACE_S`, timed by faulthandler's C thread, which needs no GIL: a cleanup that hangs ends
with exit 1 and every thread's traceback on stderr. Both deadlines end with the run, so a
program that calls `run()` and handles its exception goes on. A thread that holds the GIL
inside one C call (no Python thread can run then) is the one case the signal deadline cannot
cut short; the fatal one can.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNAL_GRACE_S = 8.0  # after a SIGTERM/SIGINT: an orderly stop's flush takes well under this
FATAL_GRACE_S = 10.0  # after a fatal error: the run's cleanup
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Watchdog:
    """The deadlines of one run (see the module docstring)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._done = threading.Event()
        self._armed_fatal = False

    def watch(self, sock: socket.socket) -> None:
        """The watchdog thread: wait for a stop signal's byte, then for the grace period."""
        with sock:
            while True:
                data = sock.recv(1)
                if not data:  # the run ended: the write end is closed
                    return
                if data[0] in _STOP_SIGNALS:
                    break
        if self._done.wait(self.grace):
            return
        name = signal.Signals(data[0]).name
        msg = f"batchgen: still busy {self.grace:.0f} s after {name}; exiting now (rerun resumes)\n"
        os.write(2, msg.encode())  # fd 2: sys.stderr may be a test's capture
        os._exit(128 + data[0])

    def arm_fatal(self, grace: float = FATAL_GRACE_S) -> None:
        """A fatal error: the cleanup from here on has `grace` seconds (armed once)."""
        if not self._armed_fatal:
            faulthandler.dump_traceback_later(grace, exit=True, file=sys.__stderr__)
            self._armed_fatal = True

    def end(self) -> None:
        self._done.set()
        if self._armed_fatal:
            faulthandler.cancel_dump_traceback_later()


@contextmanager
def deadlines(grace: float = SIGNAL_GRACE_S) -> Iterator[Watchdog]:
    """A run's deadlines, from here to the end of the block. Off the main thread (which alone
    gets signals) only the fatal one works."""
    dog = Watchdog(grace)
    if threading.current_thread() is not threading.main_thread():
        try:
            yield dog
        finally:
            dog.end()
        return
    read, write = socket.socketpair()
    write.setblocking(False)  # the C handler must never block on it
    old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=dog.watch, args=(read,), daemon=True, name="stop-deadline")
    thread.start()
    try:
        yield dog
    finally:
        signal.set_wakeup_fd(old_fd)
        dog.end()
        write.close()  # the thread's recv returns b"" and it ends
        thread.join()  # at once: no thread outlives the run
