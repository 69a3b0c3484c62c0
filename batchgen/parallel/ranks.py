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
    and exits 1, and `close` ends the remaining ranks; one that dies while starting is seen
    within a second of the rendezvous (group.py);
  - a rank that stops answering while rank 0 waits on it (a step, the load barrier, the
    rendezvous) is ended by the watchdog (watchdog.py), which names it;
  - on NCCL a dead peer can leave a collective waiting: the watchdog's thread sees it exit,
    aborts the group (the waiting call then fails) and, should rank 0 still not have stopped
    after `GRACE` seconds, exits the process;
  - an error of rank 0's own (out of memory, a compile error) is raised as itself; a command
    the others had already been sent leaves them out of step, so they are ended then, and the
    next command raises RankFailed;
  - rank 0 dying takes the others with it: they hold PR_SET_PDEATHSIG, which follows the
    thread that started them, so they are started by a thread of their own that lives until
    `close` (an LLM made in a short-lived thread keeps its ranks).
`close` gives the ranks `CLOSE_S` to exit, inside the run's fatal-error deadline.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, NoReturn

import torch.distributed as dist

from batchgen.engine.decode_mask import DecodeMask
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import StepPlan
from batchgen.engine.step_inputs import StepInputs, WarmUp
from batchgen.errors import RankFailed
from batchgen.model.families.transformer import Transformer
from batchgen.parallel import channel
from batchgen.parallel.error_files import ErrorFiles
from batchgen.parallel.group import Group, init_group, listen, rendezvous
from batchgen.parallel.rank_model import RankSpec
from batchgen.parallel.watchdog import Watchdog

GRACE = 60.0  # seconds rank 0 may take to stop after a rank died, before it is ended
SETTLE_S = 5.0  # after a collective failed: how long the dead rank's exit may take to show
CLOSE_S = 5.0  # close(): the ranks' time to exit (under deadline.FATAL_GRACE_S)
# A failure's advice: a job's (`batchgen run`), or the Python API's.
RESUME = (
    "the job stops, its finished rows are saved; fix the cause and run the same command again "
    "to resume"
)
REOPEN = "this LLM can run nothing more: close() it and create a new one"


class Ranks:
    """Ranks 1..N-1, started and joined to rank 0's group."""

    def __init__(self, spec: RankSpec, threads: int, *, resumable: bool = True) -> None:
        """Start the other ranks and form the group (the caller loads its own part, then
        calls `loaded`). threads: CPU threads per rank. resumable: a failure's advice is a
        job's (run the same command again), else the Python API's (a new LLM)."""
        size = spec.tensor_parallel_size
        self.vocab_size = spec.model_cfg.vocab_size  # the whole model's, as every rank's logits
        if dist.is_initialized():  # torch keeps one default process group per process
            raise RuntimeError(
                "another tensor-parallel LLM is open in this process; close() it first"
            )
        self._errors = ErrorFiles()
        self._advice = RESUME if resumable else REOPEN
        self._closing = False
        self._closed = threading.Event()
        self._failed: str | None = None  # set once the ranks cannot go on: why
        self._sent = 0  # commands sent
        self.token = secrets.token_hex(16)  # the store's keys: only the job's ranks know it
        self.procs: list[subprocess.Popen] = []
        self._watchdog = Watchdog(self.procs)
        sock = None
        try:
            sock = listen()
            self.port = sock.getsockname()[1]
            started: Future[None] = Future()
            self._keeper = threading.Thread(
                target=self._keep, args=(size, started), daemon=True, name="tp-ranks"
            )
            self._keeper.start()
            started.result()
            self.send(("start", spec, threads, self.token))
            with self._watchdog.waiting():
                store = rendezvous(0, size, self.port, self.token, self.check, sock)
            self.group: Group = init_group(store, 0, size, spec.device_of(0))
        except BaseException:
            if sock is not None:
                sock.close()  # unless the store took it over
            self.close()
            raise

    def _keep(self, size: int, started: Future[None]) -> None:
        """The ranks' thread: start them, watch them, and live until `close` (their
        PR_SET_PDEATHSIG fires when the thread that started them ends)."""
        try:
            for r in range(1, size):
                cmd = [sys.executable, "-m", "batchgen.parallel.follower"]
                cmd += ["--rank", str(r), "--size", str(size), "--port", str(self.port)]
                cmd += ["--parent", str(os.getpid()), "--error-file", str(self._errors.path(r))]
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE))
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(None)
        self._watch()
        self._closed.wait()

    def loaded(self) -> None:
        """Wait until every rank has loaded its part (one that failed: RankFailed)."""
        with self.failures():
            self.group.barrier()

    def send(self, message: Any) -> None:
        if self._failed is not None:
            raise RankFailed(self._failed)
        packed = channel.pack(message)
        self._sent += 1
        for proc in self.procs:
            try:
                channel.write(proc.stdin, packed)
            except (BrokenPipeError, OSError):
                self._raise_failed()

    def check(self) -> None:
        """RankFailed if a rank has exited."""
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                self._fail(self._why(rank, proc))

    def _fail(self, message: str) -> NoReturn:
        self._failed = self._failed or message
        raise RankFailed(message)

    def _raise_failed(self) -> NoReturn:
        """A rank's pipe or collective failed: name the rank that exited (waiting up to
        `SETTLE_S` for it to be seen)."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            self.check()
            time.sleep(0.05)
        self._fail(f"a tensor-parallel rank stopped answering; {self._advice}")

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """A collective that fails because a rank died or stopped answering becomes
        RankFailed; rank 0's own error stays itself."""
        sent = self._sent
        try:
            with self._watchdog.waiting():
                yield
        except RankFailed:
            raise
        except BaseException as e:
            if isinstance(e, RuntimeError) and self._peer_failed(e):
                self._raise_failed()
            if self._sent != sent:  # the others run a command rank 0 gave up: out of step
                self._end_after(e)
            raise

    def _peer_failed(self, e: RuntimeError) -> bool:
        """Did this error come from another rank? One has exited or was ended, or the error
        is a collective's (whose peer may take a moment to be seen exiting)."""
        if self._watchdog.hung or any(p.poll() is not None for p in self.procs):
            return True
        return isinstance(e, dist.DistError) or any(w in str(e) for w in ("gloo", "NCCL"))

    def _end_after(self, e: BaseException) -> None:
        """Rank 0 failed mid-command: end the others now (they wait in a collective that
        will not come); later commands raise RankFailed."""
        said = (str(e).strip().splitlines() or [""])[0]
        self._failed = (
            f"the tensor-parallel ranks were ended after an error on rank 0 "
            f"({type(e).__name__}: {said}); {self._advice}"
        )
        self._kill()

    def _why(self, rank: int, proc: subprocess.Popen) -> str:
        code = proc.returncode
        if rank in self._watchdog.hung:
            how = self._watchdog.hung[rank]
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with {code}"
        return f"tensor-parallel rank {rank} {how}{self._errors.said(rank)}; {self._advice}"

    def _watch(self) -> None:
        """Until close: the watchdog's looks; when a rank dies, abort an NCCL group, and end
        this process if that does not stop it."""
        self._watchdog.watch(lambda: self._closing or self._failed is not None)
        if self._closing or self._failed is not None:
            return
        group = getattr(self, "group", None)
        if group is not None and group.data is not group.control:  # NCCL: may wait forever
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(group.data)
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
        """Tell the ranks to exit, wait `CLOSE_S` for them (then kill those left), drop the
        group and the error files."""
        self._closing = True
        if self._failed is None:
            with contextlib.suppress(Exception):
                self.send(("exit",))
            deadline = time.monotonic() + CLOSE_S
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
        self._kill()
        if getattr(self, "group", None) is not None:
            with contextlib.suppress(Exception):
                self.group.close()
        self._errors.remove()
        self._closed.set()

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

    def __init__(self, model: Transformer, ranks: Ranks, **options: Any) -> None:
        """options: ModelRunner's (block_size, compile, clock, compile_cache)."""
        # model is rank 0's part (half the vocabulary at 2): the logits' width is the whole's
        super().__init__(model, broadcast=self._send_step, vocab_size=ranks.vocab_size, **options)
        self.ranks = ranks
        if self.device.type == "cpu":
            self.host_ranks = len(ranks.procs) + 1

    def _send_step(self, inputs: StepInputs) -> None:
        self.ranks.send(("step", inputs))

    def build_graph(self, token_sizes: list[int], row_sizes: list[int]) -> None:
        self.ranks.send(("build", token_sizes, row_sizes))  # each rank loads its own cache
        super().build_graph(token_sizes, row_sizes)

    def allocate(self, num_blocks: int) -> None:
        self.ranks.send(("allocate", num_blocks))
        super().allocate(num_blocks)

    def kv_budget_bytes(self, utilization: float) -> int:
        """The least budget of any rank (the pool is allocated alike on every rank)."""
        with self.ranks.failures():
            self.ranks.send(("kv_budget", utilization))
            return self.ranks.group.min_over_ranks(super().kv_budget_bytes(utilization))

    def execute(self, plan: StepPlan, mask: DecodeMask | None = None):
        with self.ranks.failures():
            return super().execute(plan, mask)

    def warm_up(self, max_num_seqs: int, max_tokens: int) -> WarmUp:
        with self.ranks.failures():  # its steps go to every rank, as execute's
            return super().warm_up(max_num_seqs, max_tokens)
