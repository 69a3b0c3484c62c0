"""The tensor-parallel process group: NCCL between GPUs, gloo on the CPU, and on CUDA a second,
gloo group for the host-side handshakes (barriers), which fails fast when a peer is gone.

Rank 0 hosts the rendezvous (a TCPStore on a free local port) and waits for each rank to
check in while watching the rank's process, so a rank that dies while starting is reported at
once instead of after the rendezvous timeout. Collectives time out after `TIMEOUT`: a rank
that stops answering ends the job with an error, never a hang.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

HOST = "127.0.0.1"
# Longer than any step, compiles included; a dead peer on gloo errors at once, and rank 0's
# watchdog aborts an NCCL group whose peer died (ranks.py).
TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Group:
    rank: int
    size: int
    data: ProcessGroup  # the model's collectives
    control: ProcessGroup  # host-side handshakes (gloo)

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rendezvous(
    rank: int, size: int, port: int, wait: Callable[[], None] | None = None
) -> dist.TCPStore:
    """The group's store; rank 0 hosts it and, with `wait`, polls each rank's check-in
    (wait() raises if a rank died meanwhile)."""
    store = dist.TCPStore(HOST, port, size, is_master=rank == 0, timeout=TIMEOUT)
    store.set(f"batchgen/joined/{rank}", "1")
    if rank == 0 and wait is not None:
        keys = [f"batchgen/joined/{r}" for r in range(1, size)]
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=1))
                break
            except dist.DistStoreError:  # not all in yet
                wait()
    return store


def init_group(store: dist.TCPStore, rank: int, size: int, device: torch.device) -> Group:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT, **kw)
    world = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else world
    return Group(rank, size, world, control)
