"""Tensor-parallel failures from the audit (issue 32), with real ranks over gloo on the CPU: the
rendezvous is reachable from loopback only and keyed by a secret token; a rank that dies while
starting, or stops answering, ends the job in seconds with one line naming it; rank 0's own
error is raised as itself; no stale directory or collective warning is left; an LLM made in a
thread that ends keeps its ranks, and a rank's SIGTERM does not kill the API user's process."""

import contextlib
import datetime
import fcntl
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import FAST, ROOT, assert_one_line_error, prompts, wait_for_part, write_parquet

from batchgen.engine.sequence import SamplingParams
from batchgen.errors import RankFailed
from batchgen.llm import LLM
from batchgen.parallel import watchdog

PROMPTS = [[2, 3, 5, 7, 11], [13, 17, 19]]
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
# A job of 24 rows in parts of 4, running for seconds at two ranks.
FLAGS = ("--max-new-tokens", 16, "--ignore-eos", "--max-num-seqs", 4, "--rows-per-part", 4)
FLAGS = (*FLAGS, "--flush-seconds", 0, "-tp", 2)


@pytest.fixture
def start_cli():
    """start_cli(setup, *args): `batchgen ARGS` as its own process, after the Python lines
    `setup` ran in it; killed at the end of the test (its ranks die with it)."""
    started = []

    def start(setup: str, *args) -> subprocess.Popen:
        code = f"{setup}\nfrom batchgen.cli.main import main\nmain()"
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", code, *map(str, args)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        )
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.communicate()


@pytest.fixture
def job(model, tmp_path):
    """The arguments of a two-rank `batchgen run` of 24 rows."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(24)})
    return ("run", src, "-o", tmp_path / "out", "--model", model, *FAST, *FLAGS)


# Each follower rank is SIGKILLed half a second after it starts: while it imports torch, after
# rank 0 wrote it the start command, before it checks in.
KILL_FOLLOWERS_AT_START = """
import signal, subprocess, threading
class Dying(subprocess.Popen):
    def __init__(self, cmd, *args, **kw):
        super().__init__(cmd, *args, **kw)
        if "batchgen.parallel.follower" in cmd:
            threading.Timer(0.5, self.send_signal, (signal.SIGKILL,)).start()
subprocess.Popen = Dying
"""


def test_a_rank_dead_at_start_ends_the_job_within_seconds(job, start_cli):
    t0 = time.monotonic()
    proc = start_cli(KILL_FOLLOWERS_AT_START, *job)
    _, stderr = proc.communicate(timeout=60)  # before the fix: the store waited 10 minutes
    assert proc.returncode == 1, stderr
    assert time.monotonic() - t0 < 30
    assert_one_line_error(stderr, "tensor-parallel rank 1 was killed by SIGKILL")


def test_rank_0s_own_error_is_raised_as_itself(model, monkeypatch):
    with LLM(model, device="cpu", tensor_parallel_size=2) as llm:

        def out_of_memory(*args, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(llm.model, "forward", out_of_memory)
        t0 = time.monotonic()
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            llm.generate(PROMPTS, PARAMS)
        assert time.monotonic() - t0 < 3  # no wait for a rank to be seen dying
        # Rank 1 had the step and waits in its collective: it is ended, and the LLM says so.
        assert llm.ranks.procs[0].wait(5) is not None
        with pytest.raises(RankFailed, match=r"error on rank 0 \(OutOfMemoryError: CUDA out"):
            llm.generate(PROMPTS, PARAMS)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket process pid listens on (/proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile (the listing's own)
            inodes.add(os.readlink(fd))
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f"socket:[{f[9]}]" not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)  # 32-bit words, each little-endian
            ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            if ip.version == 6 and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            found.add((str(ip), int(port, 16)))
    return found


def test_the_store_listens_on_loopback_under_a_secret_token(model):
    with LLM(model, device="cpu", tensor_parallel_size=2) as llm:
        follower = llm.ranks.procs[0].pid
        sockets = _listening(os.getpid()) | _listening(follower)
        assert ("127.0.0.1", llm.ranks.port) in sockets
        assert {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
        token = llm.ranks.token
        assert len(token) == 32
        for seen in ("cmdline", "environ"):  # readable by others, or by children
            assert token.encode() not in Path(f"/proc/{follower}/{seen}").read_bytes()
        client = dist.TCPStore("127.0.0.1", llm.ranks.port, timeout=datetime.timedelta(seconds=5))
        assert client.check([f"batchgen/{token}/joined/1"])
        assert not client.check(["batchgen/joined/1"])  # what a forger would have set
        client.set("batchgen/joined/1", "1")
        assert llm.generate(PROMPTS, PARAMS)[0].token_ids
    with LLM(model, device="cpu", tensor_parallel_size=2) as again:
        assert again.ranks.token != token


def test_a_stopped_rank_is_named_within_the_bound(model, monkeypatch):
    monkeypatch.setattr(watchdog, "STOPPED_S", 1.0)
    with LLM(model, device="cpu", tensor_parallel_size=2) as llm:
        follower = llm.ranks.procs[0]
        os.kill(follower.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 was stopped \(SIGSTOP\) .* for 1 s"):
            llm.generate(PROMPTS, PARAMS)
        assert time.monotonic() - t0 < 10
        assert follower.poll() is not None
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3  # close() waits for no one


def test_a_silent_rank_is_named_after_the_answer_bound(model, monkeypatch):
    """A rank that does not answer and is not seen stopped (hung, say): ended after ANSWER_S."""
    with LLM(model, device="cpu", tensor_parallel_size=2) as llm:
        # Set once started: under load a rank's start alone (torch's import) can take 2 s.
        monkeypatch.setattr(watchdog, "ANSWER_S", 2.0)
        monkeypatch.setattr(watchdog, "_state", lambda pid: "S")  # its stop goes unseen
        os.kill(llm.ranks.procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 did not answer for 2 s"):
            llm.generate(PROMPTS, PARAMS)
        assert time.monotonic() - t0 < 10


def test_a_stopped_rank_ends_the_cli_job_with_one_line(job, tmp_path, start_cli):
    proc = start_cli("import batchgen.parallel.watchdog as w\nw.STOPPED_S = 2.0", *job)
    wait_for_part(tmp_path / "out", proc)
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    (follower,) = map(int, found.stdout.split())
    os.kill(follower, signal.SIGSTOP)
    t0 = time.monotonic()
    _, stderr = proc.communicate(timeout=60)  # before the fix: 10 minutes, then a thread dump
    assert proc.returncode == 1, stderr
    assert time.monotonic() - t0 < 15
    assert_one_line_error(stderr, "rank 1 was stopped (SIGSTOP) and did not answer for 2 s")


def test_no_stale_directory_and_no_collective_warning(model, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid is free now, as a killed job's rank 0's
    ours = os.getpid()
    gone = tmp_path / f"batchgen-ranks-{ended.pid}-x"
    kept = tmp_path / f"batchgen-ranks-{os.getppid()}-y"  # a running job's
    for d in (gone, kept):
        d.mkdir()
    with LLM(model, device="cpu", tensor_parallel_size=2) as llm:
        assert not gone.exists() and kept.exists()
        assert list(tmp_path.glob(f"batchgen-ranks-{ours}-*"))
        llm.generate(PROMPTS, PARAMS)
    assert not list(tmp_path.glob(f"batchgen-ranks-{ours}-*"))
    assert "unwaited collective" not in capfd.readouterr().err


def test_an_llm_made_in_a_thread_that_ended_keeps_its_ranks(model):
    made = []
    maker = threading.Thread(
        target=lambda: made.append(LLM(model, device="cpu", tensor_parallel_size=2))
    )
    maker.start()
    maker.join()
    with made[0] as llm:
        time.sleep(0.5)  # time for a rank killed with the thread to be gone
        assert llm.ranks.procs[0].poll() is None
        assert len(llm.generate(PROMPTS, PARAMS)[1].token_ids) == 4


# A Python program on the API whose rank 1 gets SIGTERM.
SIGTERM_UNDER_THE_API = """
import os, signal, sys
import batchgen.llm
from batchgen.engine.sequence import SamplingParams
from batchgen.errors import RankFailed
llm = batchgen.llm.LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
os.kill(llm.ranks.procs[0].pid, signal.SIGTERM)
llm.ranks.procs[0].wait(10)
try:
    llm.generate([[2, 3, 5]], SamplingParams(max_new_tokens=2))
except RankFailed as e:
    print(f"RankFailed: {e}")
llm.close()
"""


def test_sigterm_to_a_rank_spares_the_api_users_process(model):
    r = subprocess.run(
        [sys.executable, "-c", SIGTERM_UNDER_THE_API, str(model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr  # before the fix: -15, killed by its own rank
    assert "RankFailed: tensor-parallel rank 1 was killed by SIGTERM" in r.stdout
    assert "close() it and create a new one" in r.stdout and "same command" not in r.stdout


def _routable_interface() -> str | None:
    """A network interface with an IPv4 address other than loopback's, if the machine has one."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if not ipaddress.ip_address(raw[20:24]).is_loopback:
            return name
    return None


def test_gloo_sockets_stay_on_loopback_whatever_gloo_socket_ifname_says(model, monkeypatch):
    """gloo binds the interface GLOO_SOCKET_IFNAME names (else the host name's address): the
    groups are made with it set to loopback, and the caller's value is put back after."""
    routable = _routable_interface()
    if routable is None:
        pytest.skip("no network interface besides loopback")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", routable)  # the follower inherits it too
    with LLM(model, device="cpu", tensor_parallel_size=2) as llm:
        assert os.environ["GLOO_SOCKET_IFNAME"] == routable
        follower = llm.ranks.procs[0].pid
        sockets = _listening(os.getpid()) | _listening(follower)
        assert {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
        assert llm.generate(PROMPTS, PARAMS)[0].token_ids
