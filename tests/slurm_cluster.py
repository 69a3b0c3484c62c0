"""A real one-node Slurm cluster on localhost, for the tests of `batchgen slurm`.

    python tests/slurm_cluster.py start    # install if missing, start munge + slurmctld + slurmd
    python tests/slurm_cluster.py stop     # stop what `start` began, unless a test run uses it
    python tests/slurm_cluster.py status

Needs root and, when Slurm is not installed yet, apt-get (Debian packages slurm-wlm and munge).
`start` is idempotent: a cluster that already answers is used as it is, and only the daemons
started here are stopped (by their process ids), by the last test run using them: two runs may
share this machine, and one that ends must not take the node from under the other. What worked,
and why each setting is there, is in shared/notes/slurm-on-one-machine.md: no systemd and no
cgroups, so processes are tracked by /proc (proctrack/linuxproc, task/none) and everything runs
as root.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
MARK = "# written by batchgen tests/slurm_cluster.py"
STATE = Path("/run/batchgen-slurm-cluster.json")  # pids of the daemons LocalSlurm started
LOCK = Path("/run/batchgen-slurm-cluster.lock")  # shared by each test run using the cluster
MUTEX = Path("/run/batchgen-slurm-cluster.mutex")  # held while starting or stopping
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_PID = Path("/run/munge/munged.pid")
CTLD_PID = Path("/run/slurmctld.pid")
SLURMD_PID = Path("/run/slurmd.pid")
LOG_DIR = Path("/var/log/slurm")
PACKAGES = ("slurm-wlm", "munge")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not root, no apt-get, a daemon that will not start)."""


def _run(*cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)
    except subprocess.CalledProcessError as e:
        raise SlurmUnavailable(
            f"{' '.join(cmd)} failed ({e.returncode}): {(e.stderr or e.stdout).strip()[-2000:]}"
        ) from e
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmUnavailable(f"{' '.join(cmd)}: {e}") from e


def _alive(pid_file: Path) -> int | None:
    """The pid in pid_file if that process runs, else None."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def _wait_for(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise SlurmUnavailable(f"{what} did not come up within {timeout:.0f} s")


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt-get, only if a daemon is missing."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")


def _start_munge() -> int | None:
    """Start munged as user munge unless one runs; returns the pid if started here."""
    if _alive(MUNGE_PID):
        return None
    for d in ("/etc/munge", "/var/log/munge", "/run/munge", "/var/lib/munge"):
        os.makedirs(d, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    if not MUNGE_KEY.exists():
        MUNGE_KEY.write_bytes(secrets.token_bytes(1024))
    shutil.chown(MUNGE_KEY, "munge", "munge")
    MUNGE_KEY.chmod(0o400)
    _run("runuser", "-u", "munge", "--", "munged")
    _wait_for("munged", lambda: _alive(MUNGE_PID), 10)
    cred = _run("munge", "-n").stdout
    r = subprocess.run(["unmunge"], input=cred, capture_output=True, text=True, timeout=10)
    if r.returncode:
        raise SlurmUnavailable(f"munge does not work: {r.stdout}{r.stderr}")
    return _alive(MUNGE_PID)


def _write_conf() -> None:
    """A one-node config, unless one not written here exists (then that cluster is used)."""
    if CONF.exists() and MARK not in CONF.read_text():
        return
    host = socket.gethostname().split(".")[0]
    # slurmd -C reports this machine's real CPUs and memory; a node line promising more
    # than the machine has would leave the node drained.
    node = next(
        line for line in _run("slurmd", "-C").stdout.splitlines() if line.startswith("NodeName=")
    )
    for d in ("/var/spool/slurmctld", "/var/spool/slurmd", str(LOG_DIR), str(CONF.parent)):
        os.makedirs(d, exist_ok=True)
    CONF.write_text(f"""{MARK}: a one-node test cluster
ClusterName=batchgen-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued task may start again after cred_expire seconds (default 120)
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
SlurmctldPidFile={CTLD_PID}
SlurmdPidFile={SLURMD_PID}
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile={LOG_DIR}/slurmctld.log
SlurmdLogFile={LOG_DIR}/slurmd.log
{node}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")


def _node_ready() -> bool:
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    states = r.stdout.split()
    return (
        r.returncode == 0
        and bool(states)
        and all(s in ("idle", "mixed", "allocated") for s in states)
    )


def cluster_up() -> bool:
    """True when a controller answers and its node takes jobs."""
    if not shutil.which("sinfo"):
        return False
    try:
        return _node_ready()
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class LocalSlurm:
    """start() to use the cluster (starting what is missing), stop() when done with it.

    Two test runs may share this machine (a developer's `make test` and CI's): each user holds
    a shared lock on LOCK while it uses the cluster, and stop() ends the daemons that any
    LocalSlurm started (STATE) only when it can take that lock exclusively, i.e. when it is the
    last user. Starts and stops take turns on MUTEX. A cluster found running that no
    LocalSlurm started is never stopped.
    """

    started: dict[str, int] = field(default_factory=dict)  # daemon -> pid, started by start()
    _lock: int | None = field(default=None, repr=False)

    def start(self, timeout: float = 60) -> LocalSlurm:
        with _locked(MUTEX):  # one start or stop at a time
            try:
                if not cluster_up():
                    self._start_missing(timeout)
            except BaseException:
                self._stop_daemons(self.started)
                self.started.clear()
                raise
            self._lock = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock, fcntl.LOCK_SH)  # a user of the cluster until stop()
        return self

    def _start_missing(self, timeout: float) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("no Slurm cluster answers, and starting one needs root")
        ensure_installed()
        if pid := _start_munge():
            self.started["munged"] = pid
        _write_conf()
        if not _alive(CTLD_PID):
            # -c: drop the jobs and node states an earlier test cluster saved; a job left
            # running by a killed test run would otherwise hold the one node when it restarts
            _run("slurmctld", "-c")
            _wait_for("slurmctld", lambda: _alive(CTLD_PID), 15)
            self.started["slurmctld"] = _alive(CTLD_PID)
        if not _alive(SLURMD_PID):
            _run("slurmd")
            _wait_for("slurmd", lambda: _alive(SLURMD_PID), 15)
            self.started["slurmd"] = _alive(SLURMD_PID)
        _save_started({**_load_started(), **self.started})
        _wait_for("the Slurm node", cluster_up, timeout)

    def stop(self, timeout: float = 20) -> dict[str, int]:
        """Stop the started daemons if no one else uses the cluster; returns those stopped."""
        with _locked(MUTEX):
            fd = self._lock if self._lock is not None else os.open(LOCK, os.O_RDWR | os.O_CREAT)
            self._lock = None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # from shared: the last user?
            except BlockingIOError:
                return {}  # another test run still uses it; the last one out stops it
            finally:
                os.close(fd)  # (after a successful flock too: MUTEX keeps new users out)
            started = _load_started()
            self._stop_daemons(started, timeout)
            _save_started({})
            self.started.clear()
            return started

    @staticmethod
    def _stop_daemons(started: dict[str, int], timeout: float = 20) -> None:
        # Reverse order of starting: slurmd, slurmctld, then munged.
        for name, pid in reversed(list(started.items())):
            if not _is(pid, name):
                continue  # gone, or the pid now belongs to another process
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and _is(pid, name):
                time.sleep(0.2)
            if _is(pid, name):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _is(pid: int, name: str) -> bool:
    """True while process pid runs the program name (not a later process given its pid, nor
    a zombie: its comm stays until its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
    return comm == name[:15] and state not in "ZX"


def _load_started() -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads(STATE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_started(started: dict[str, int]) -> None:
    if started:
        STATE.write_text(json.dumps(started))
    else:
        STATE.unlink(missing_ok=True)


def logs_tail(n: int = 40) -> str:
    """The ends of the daemon logs, for a failing test's message."""
    out = []
    for name in ("slurmctld.log", "slurmd.log"):
        p = LOG_DIR / name
        if p.exists():
            out.append(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:]))
    return "\n".join(out)


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else "status"
    if cmd == "start":
        try:
            started = LocalSlurm().start().started
        except SlurmUnavailable as e:
            sys.exit(f"cannot start Slurm: {e}\n{logs_tail()}")
        print(f"Slurm up; started here: {started or 'nothing (already running)'}")
    elif cmd == "stop":
        stopped = LocalSlurm().stop()
        print(f"stopped: {stopped or 'nothing (not started here, or in use by a test run)'}")
    elif cmd == "status":
        print("up" if cluster_up() else "down")
        sys.exit(0 if cluster_up() else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
