"""A tensor-parallel rank other than 0: `python -m batchgen.parallel.follower --rank R ...`,
started by rank 0 (ranks.py), never by hand.

It reads rank 0's commands from its stdin (channel.py): first the spec of the model to load,
then, for the life of the job, each step's model inputs (run its part of the forward, whose
collectives meet rank 0's), the KV pool's allocation and free-memory queries, and `exit`.
It samples nothing and writes nothing.

Lifetime: it dies with rank 0 (PR_SET_PDEATHSIG, so a SIGKILLed rank 0 leaves no orphan; it
follows the rank-0 thread that started this rank, which lives until the ranks are closed). It
ignores SIGINT (a terminal's Ctrl-C reaches the whole process group, and rank 0 stops the job
cleanly). A SIGTERM goes on to rank 0 where rank 0 catches SIGTERM (a job's loop does: it
stops the job and then tells this rank to exit); where rank 0 does not (the Python API, whose
process the signal would kill), this rank dies of it and rank 0 raises RankFailed. A failure
writes one line to --error-file for rank 0's message and exits 1.

The store's key token comes with the first command, over the pipe: never in argv (which any
user can read) or the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from batchgen.engine.model_runner import ModelRunner
from batchgen.model.parallel.sharding import TPShard
from batchgen.parallel.channel import read
from batchgen.parallel.group import init_group, rendezvous
from batchgen.parallel.rank_model import RankSpec, load_rank_model

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux: rank 0's ranks
    thread, or the whole process); if that already happened, exit now."""
    # Not Linux: no prctl, but rank 0's pipe closing still ends this rank (EOF).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _catches(pid: int, signum: int) -> bool:
    """Does process pid handle signum itself (Linux: /proc's SigCgt mask)? False if unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _signals(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sent: list[int] = []

    def to_rank0(signum, frame):  # once: rank 0 stops the job and tells this rank to exit
        if sent:
            return
        sent.append(signum)
        if _catches(parent, signum):
            os.kill(parent, signum)
        else:  # it would end rank 0's process: end this rank instead, as SIGTERM does
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, to_rank0)


def serve(rank: int, size: int, port: int) -> None:
    """Load this rank's part and follow rank 0's commands until `exit`."""
    commands = sys.stdin.buffer
    kind, spec, threads, token = read(commands)
    assert kind == "start" and isinstance(spec, RankSpec), kind
    device = spec.device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)
    group = init_group(rendezvous(rank, size, port, token), rank, size, device)
    part = load_rank_model(spec, TPShard(rank, size), group.data)
    cache = spec.compile_caches[rank] if spec.compile_caches else None  # this rank's own
    runner = ModelRunner(
        part.model, block_size=spec.block_size, compile=spec.compile, compile_cache=cache
    )
    group.barrier()  # loaded: rank 0 waits for every rank here
    with torch.no_grad():
        while True:
            kind, *args = read(commands)
            if kind == "step":
                runner.forward(*args)
            elif kind == "allocate":
                runner.allocate(*args)
            elif kind == "build":
                runner.build_graph(*args)
            elif kind == "kv_budget":
                group.min_over_ranks(runner.kv_budget_bytes(*args))
            elif kind == "exit":
                break
            else:
                raise ValueError(f"unknown command {kind!r}")
    group.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="a tensor-parallel rank (started by rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--error-file", required=True)
    a = p.parse_args(argv)
    _die_with(a.parent)
    _signals(a.parent)
    try:
        serve(a.rank, a.size, a.port)
    except EOFError:  # rank 0 is gone
        sys.exit(1)
    except Exception as e:  # any failure: one line for rank 0, then exit
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        with contextlib.suppress(OSError), open(a.error_file, "w") as f:  # rank 0 may be gone
            f.write(f"{type(e).__name__}: {first}")
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
