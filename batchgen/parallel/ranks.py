"""Rank 0's view of the other tensor-parallel ranks: it starts them (no torchrun: `batchgen
run --tensor-parallel-size N` is the whole command), sends each command to all of them, and
turns any rank's death into one clear error.

Commands go over pipes (channel.py); `RankedRunner` is rank 0's model runner, which sends the
other ranks each step's inputs before running its own part, so every rank runs the same
forward and their collectives meet.

Failures end the whole job within a bounded time, with no process left behind:
  - a rank that dies (killed, out of memory, an exception) breaks rank 0's pipe to it or its
    collective (gloo errors at once when a peer's socket closes); rank 0 then raises
    `RankFailed` naming the rank and its last error line, the job flushes its finished rows
    and exits 1, and `close` ends the remaining ranks;
  - on NCCL a dead peer can leave a collective waiting: a watchdog thread sees the process
    exit, aborts the group (the waiting call then fails) and, should rank 0 still not have
    stopped after `GRACE` seconds, exits the process;
  - rank 0 dying takes the others with it (they hold PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import StepPlan
from batchgen.engine.step_inputs import StepInputs
from batchgen.errors import RankFailed
from batchgen.model.tp_layers import CollectiveClock
from batchgen.model.transformer import Transformer
from batchgen.parallel import channel
from batchgen.parallel.group import Group, free_port, init_group, rendezvous
from batchgen.parallel.rank_model import RankSpec

GRACE = 60.0  # seconds rank 0 may take to stop after a rank died, before it is ended


class Ranks:
    """Ranks 1..N-1, started and joined to rank 0's group."""

    def __init__(self, spec: RankSpec, threads: int) -> None:
        """Start the other ranks and form the group (the caller loads its own part, then
        calls `loaded`). threads: CPU threads per rank."""
        size = spec.tensor_parallel_size
        if dist.is_initialized():  # torch keeps one default process group per process
            raise RuntimeError(
                "another tensor-parallel LLM is open in this process; close() it first"
            )
        port = free_port()
        self._tmp = Path(tempfile.mkdtemp(prefix="batchgen-ranks-"))
        self._closing = False
        self.procs: list[subprocess.Popen] = []
        try:
            for r in range(1, size):
                cmd = [
                    sys.executable,
                    "-m",
                    "batchgen.parallel.follower",
                    "--rank",
                    str(r),
                    "--size",
                    str(size),
                    "--port",
                    str(port),
                    "--parent",
                    str(os.getpid()),
                    "--error-file",
                    str(self._error_file(r)),
                ]
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE))
            self.send(("start", spec, threads))
            store = rendezvous(0, size, port, wait=self.check)
            self.group: Group = init_group(store, 0, size, spec.device_of(0))
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    def _error_file(self, rank: int) -> Path:
        return self._tmp / f"rank-{rank}.error"

    def loaded(self) -> None:
        """Wait until every rank has loaded its part (one that failed: RankFailed)."""
        with self.failures():
            self.group.barrier()

    def send(self, message: Any) -> None:
        packed = channel.pack(message)
        for proc in self.procs:
            try:
                channel.write(proc.stdin, packed)
            except (BrokenPipeError, OSError):
                self._raise_failed()

    def check(self) -> None:
        """RankFailed if a rank has exited."""
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                raise RankFailed(self._why(rank, proc))

    def _raise_failed(self, settle: float = 5.0) -> NoReturn:
        """A rank's pipe or collective failed: name the rank that exited (waiting up to
        `settle` seconds for it to be seen)."""
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            self.check()
            time.sleep(0.05)
        raise RankFailed("a tensor-parallel rank stopped answering; the job stops")

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """A collective that fails because a rank died becomes RankFailed."""
        try:
            yield
        except (RuntimeError, dist.DistError):
            self._raise_failed()

    def _why(self, rank: int, proc: subprocess.Popen) -> str:
        code = proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        error = self._error_file(rank)
        said = f" ({error.read_text().strip()})" if error.is_file() else ""
        return (
            f"tensor-parallel rank {rank} {how}{said}; the job stops, its finished rows are "
            "saved; fix the cause and run the same command again to resume"
        )

    def _watch(self) -> None:
        """Abort the group when a rank dies, and end this process if that does not stop it."""
        while not self._closing:
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        if self._closing:
            return
        if self.group.data is not self.group.control:  # NCCL: a collective may wait forever
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(self.group.data)
            deadline = time.monotonic() + GRACE
            while not self._closing and time.monotonic() < deadline:
                time.sleep(0.5)
            if not self._closing:
                for rank, proc in enumerate(self.procs, 1):
                    if proc.poll() is not None:
                        print(f"Error: {self._why(rank, proc)}", file=sys.stderr, flush=True)
                self._kill()
                os._exit(1)

    def close(self) -> None:
        """Tell the ranks to exit, wait for them (then kill those left), drop the group."""
        self._closing = True
        with contextlib.suppress(Exception):
            self.send(("exit",))
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        self._kill()
        if getattr(self, "group", None) is not None:
            with contextlib.suppress(Exception):
                self.group.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()


class RankedRunner(ModelRunner):
    """Rank 0's runner: every command reaches the other ranks before it runs here."""

    def __init__(
        self,
        model: Transformer,
        ranks: Ranks,
        *,
        block_size: int,
        compile: bool = False,
        clock: CollectiveClock | None = None,
    ) -> None:
        super().__init__(
            model, block_size=block_size, compile=compile, broadcast=self._send_step, clock=clock
        )
        self.ranks = ranks
        if self.device.type == "cpu":
            self.host_ranks = len(ranks.procs) + 1

    def _send_step(self, inputs: StepInputs) -> None:
        self.ranks.send(("step", inputs))

    def allocate(self, num_blocks: int) -> None:
        self.ranks.send(("allocate", num_blocks))
        super().allocate(num_blocks)

    def free_device_bytes(self) -> int | None:
        """The least free memory of any rank (the pool is allocated alike on every rank)."""
        free = super().free_device_bytes()
        if free is None:
            return None
        self.ranks.send(("free_bytes",))
        with self.ranks.failures():
            return self.ranks.group.min_over_ranks(free)

    def execute(self, plan: StepPlan, bitmask: torch.Tensor | None = None):
        with self.ranks.failures():
            return super().execute(plan, bitmask)
