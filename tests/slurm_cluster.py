"""A real one-node Slurm cluster on localhost, for the tests of `batchgen slurm`.

    python tests/slurm_cluster.py start    # install if missing, start munge + slurmctld + slurmd
    python tests/slurm_cluster.py stop     # stop the daemons that `start` started
    python tests/slurm_cluster.py status

Needs root and, when Slurm is not installed yet, apt-get (Debian packages slurm-wlm and munge).
`start` is idempotent: a cluster that already answers is used as it is, and only the daemons
started here are stopped (by their process ids, from their pid files). What worked, and why each
setting is there, is in shared/notes/slurm-on-one-machine.md: no systemd and no cgroups, so
processes are tracked by /proc (proctrack/linuxproc, task/none) and everything runs as root.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
MARK = "# written by batchgen tests/slurm_cluster.py"
STATE = Path("/run/batchgen-slurm-cluster.json")  # pids of the daemons started here
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
    """Start with start(), stop with stop(); stop() only ends daemons that start() began."""

    started: dict[str, int] = field(default_factory=dict)  # daemon -> pid

    def start(self, timeout: float = 60) -> LocalSlurm:
        if cluster_up():
            return self
        if os.geteuid() != 0:
            raise SlurmUnavailable("no Slurm cluster answers, and starting one needs root")
        ensure_installed()
        try:
            if pid := _start_munge():
                self.started["munged"] = pid
            _write_conf()
            if not _alive(CTLD_PID):
                # -i: ignore state saved by an earlier test cluster (jobs, node states)
                _run("slurmctld", "-i")
                _wait_for("slurmctld", lambda: _alive(CTLD_PID), 15)
                self.started["slurmctld"] = _alive(CTLD_PID)
            if not _alive(SLURMD_PID):
                _run("slurmd")
                _wait_for("slurmd", lambda: _alive(SLURMD_PID), 15)
                self.started["slurmd"] = _alive(SLURMD_PID)
            _wait_for("the Slurm node", cluster_up, timeout)
        except BaseException:
            self.stop()
            raise
        self._save()
        return self

    def stop(self, timeout: float = 20) -> None:
        if not self.started:
            return  # a cluster this instance found running is someone else's to stop
        # Reverse order of starting: slurmd, slurmctld, then munged.
        for name in reversed(list(self.started)):
            pid = self.started.pop(name)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                os.kill(pid, signal.SIGKILL)
        self._save()

    def _save(self) -> None:
        if self.started:
            STATE.write_text(json.dumps(self.started))
        else:
            STATE.unlink(missing_ok=True)

    @classmethod
    def load(cls) -> LocalSlurm:
        try:
            return cls(json.loads(STATE.read_text()))
        except (OSError, ValueError):
            return cls()


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
        cluster = LocalSlurm.load()
        try:
            cluster.start()
        except SlurmUnavailable as e:
            sys.exit(f"cannot start Slurm: {e}\n{logs_tail()}")
        print(f"Slurm up; started here: {cluster.started or 'nothing (already running)'}")
    elif cmd == "stop":
        cluster = LocalSlurm.load()
        stopped = dict(cluster.started)
        cluster.stop()
        print(f"stopped: {stopped or 'nothing started here'}")
    elif cmd == "status":
        print("up" if cluster_up() else "down")
        sys.exit(0 if cluster_up() else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
