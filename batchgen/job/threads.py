"""How many CPU threads torch runs a job's model on: the CPUs this process may use, its
affinity mask (taskset, Slurm's binding) capped by a cgroup CPU quota (a container's or a
Slurm job's `cpu.max`, rounded up), which OpenMP's own default (the affinity mask) ignores.

OpenMP splits each op evenly over its threads and waits for the last: a thread that shares
its core with another busy process holds every parallel region. With OpenMP's default
spinning the demo job took 14-38 s with 2 threads against 2.3-2.7 s with 1 thread on a busy
machine; passive waits fixed that but cost a quiet machine ~20% (a sleeping thread's wake-up,
at every parallel region). So the threads spin 0.1 ms before sleeping (`GOMP_SPINCOUNT=10000`,
set in batchgen/__init__.py before torch loads OpenMP), and while a job runs,
`ThreadGovernor` takes a thread off for each CPU that other processes keep busy, and gives it
back when they stop (`batchgen run` without --threads, on the CPU). The 192-row mixed
workload on 2 CPUs: 12.7 s quiet and 20.3 s beside a busy loop, against 15.5 and 20.4 s with
passive waits and 19.8 and 19.5 s with 1 thread (docs/benchmarks.md, "Threads, quiet and
busy")."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.job.model_spec import ModelSpec

log = logging.getLogger(__name__)

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


def governable(spec: ModelSpec) -> bool:
    """Whether a model's thread count may follow what other processes leave of the CPUs: an
    eager CPU model of one rank. Not a compiled one: inductor's C++ kernels are built for one
    thread count, and dynamo guards on it, so a change would recompile the forward."""
    return spec.device.type == "cpu" and spec.tensor_parallel_size == 1 and not spec.compile


def _busy_ticks(cpus: frozenset[int], stat: Path = Path("/proc/stat")) -> int | None:
    """Clock ticks the given CPUs spent busy since boot (user, nice, system, irq, softirq and
    steal: a hypervisor's steal is another tenant's work), None where /proc/stat is not."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            f = [int(x) for x in rest.split()]
            busy += f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)
    return busy


def _own_seconds() -> float:
    """CPU seconds this process has used, every thread of it."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Fewer threads while other processes take some of this process's CPUs; all of them
    again once they stop.

    OpenMP splits each op evenly over its threads and waits for the last one: a thread that
    shares its core with another busy process holds every parallel region (docs/benchmarks.md,
    "Threads on a busy machine"). Every `every_s` the governor reads how busy this process's
    CPUs were (/proc/stat) less this process's own CPU time; other processes' share, rounded
    to CPUs, is taken off `most`. A change needs two readings in a row that agree (or one that
    spans two intervals, as the first after the model's load does), so a short burst of another
    process's work moves nothing."""

    def __init__(
        self,
        most: int,
        set_threads: Callable[[int], None],
        every_s: float = 0.5,
        cpus: frozenset[int] | None = None,
        busy_ticks: Callable[[], int | None] | None = None,
        own_seconds: Callable[[], float] = _own_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cpus is None:
            affinity = getattr(os, "sched_getaffinity", None)
            cpus = frozenset(affinity(0)) if affinity else frozenset(range(os.cpu_count() or 1))
        self.most, self.threads, self.every_s = most, most, every_s
        self._set, self._own, self._clock = set_threads, own_seconds, clock
        self._busy = busy_ticks or (lambda: _busy_ticks(cpus))
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()
        self._proposed: int | None = None
        self.changes = 0
        self.fewest = most

    def summary(self) -> dict[str, int]:
        """stats.json's `threads`: at the start, the fewest, at the end, how many changes."""
        return {
            "start": self.most,
            "fewest": self.fewest,
            "last": self.threads,
            "changes": self.changes,
        }

    def _read(self) -> tuple[float, int | None, float]:
        return self._clock(), self._busy(), self._own()

    def other_cpus(self, before: tuple, after: tuple) -> float | None:
        """CPUs' worth of work other processes did between two readings."""
        (t0, b0, o0), (t1, b1, o1) = before, after
        if b0 is None or b1 is None or t1 <= t0:
            return None
        return max(0.0, ((b1 - b0) / self._hz - (o1 - o0)) / (t1 - t0))

    def tick(self) -> int:
        """Called between steps; reads the machine every `every_s`. Returns the thread count."""
        if self.most <= 1 or self._clock() - self._last[0] < self.every_s:
            return self.threads
        now = self._read()
        other = self.other_cpus(self._last, now)
        span, self._last = now[0] - self._last[0], now
        if other is None:
            return self.threads
        want = max(1, self.most - int(other + 0.5))
        if want == self.threads:
            self._proposed = None
        elif want == self._proposed or span >= 2 * self.every_s:  # two readings' worth: change
            log.info(
                "other processes use %.1f of this job's %d CPUs: %d torch threads, not %d",
                other,
                self.most,
                want,
                self.threads,
            )
            self.threads, self._proposed = want, None
            self.changes += 1
            self.fewest = min(self.fewest, want)
            self._set(want)
        else:
            self._proposed = want
        return self.threads
