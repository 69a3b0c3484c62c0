"""How many CPU threads torch runs a job's model on: the CPUs this process may use, its
affinity mask (taskset, Slurm's binding) capped by a cgroup CPU quota (a container's or a
Slurm job's `cpu.max`, rounded up), which OpenMP's own default (the affinity mask) ignores.

The threads wait for work passively (`OMP_WAIT_POLICY=PASSIVE`, set in batchgen/__init__.py
before torch loads OpenMP). With OpenMP's active spinning, a core busy with another process
stalls every parallel region: the demo job took 14-38 s with 2 threads against 2.3-2.7 s with
1 thread, and 1.1-1.6 s with 2 passive threads (docs/benchmarks.md, "Threads on a busy
machine")."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")  # "QUOTA PERIOD" or "max PERIOD"
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")  # cpu.cfs_quota_us (-1: none), cpu.cfs_period_us


def _quota(v2: Path, v1: Path) -> float | None:
    """The cgroup's CPU quota in CPUs (1.5: one and a half), None where there is none."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        period = int((v1 / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpu_threads(v2: Path = CGROUP_V2, v1: Path = CGROUP_V1) -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup's quota."""
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS and Windows
    n = len(affinity(0)) if affinity else os.cpu_count() or 1
    quota = _quota(v2, v1)
    return max(1, min(n, math.ceil(quota))) if quota else max(1, n)
