"""The tensor-parallel process group: NCCL between GPUs, gloo on the CPU, and on CUDA a second,
gloo group for the host-side handshakes (barriers), which fails fast when a peer is gone.

Rank 0 hosts the rendezvous, a TCPStore on a socket it binds to loopback itself (torch's store
server listens on every interface whatever host it is given) and whose keys all start with a
random token that only the job's ranks know (rank 0 hands it to the others over their command
pipes, never in argv or the environment): another host cannot reach the store, and another
local process cannot check in as a rank. The store does not wait for the other ranks itself
(`wait_for_workers=False`): rank 0 polls each rank's check-in while watching the rank's
process, so a rank that dies while starting is reported within a second instead of after the
rendezvous timeout. Collectives time out after `TIMEOUT`, a backstop behind rank 0's watchdog
(watchdog.py), which ends a step that waits on a stopped or silent rank sooner.

gloo's own sockets (the CPU group's data, and the control group on CUDA) are bound to the
loopback interface too: gloo picks its interface from GLOO_SOCKET_IFNAME, else from the
address the host name resolves to, which on many machines is a routable one. The ranks are
processes of one machine, so `init_group` sets GLOO_SOCKET_IFNAME to loopback while it creates
the groups, whatever it was, and puts the previous value back after: the variable is read when
a group is made, and the caller's process keeps its own setting for anything else.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

HOST = "127.0.0.1"
# Longer than any step, compiles included; a dead peer on gloo errors at once, and rank 0's
# watchdog aborts an NCCL group whose peer died (ranks.py).
TIMEOUT = datetime.timedelta(minutes=10)


def listen() -> socket.socket:
    """A socket listening on a free loopback port, for rank 0's store."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


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
    rank: int,
    size: int,
    port: int,
    token: str,
    wait: Callable[[], None] | None = None,
    listening: socket.socket | None = None,
) -> dist.Store:
    """The group's store, its keys under the job's token. Rank 0 hosts it on `listening` (the
    store takes the socket over) and, with `wait`, polls each rank's check-in (wait() raises
    if a rank died meanwhile)."""
    host = rank == 0
    fd = listening.detach() if host and listening is not None else None
    try:
        tcp = dist.TCPStore(
            HOST, port, size, host, TIMEOUT, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    store = dist.PrefixStore(f"batchgen/{token}", tcp)
    store.set(f"joined/{rank}", "1")
    if host and wait is not None:
        keys = [f"joined/{r}" for r in range(1, size)]
        while not store.check(keys):
            wait()
            time.sleep(0.05)
    return store


def init_group(store: dist.Store, rank: int, size: int, device: torch.device) -> Group:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    with gloo_on_loopback():
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT, **kw
        )
        world = dist.group.WORLD
        control = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else world
    return Group(rank, size, world, control)


def loopback_interface() -> str:
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), "lo")


@contextlib.contextmanager
def gloo_on_loopback() -> Iterator[None]:
    """GLOO_SOCKET_IFNAME set to loopback for the groups made inside, then as it was."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before
