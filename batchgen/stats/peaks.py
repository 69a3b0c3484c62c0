"""The hardware's peak FLOP/s and memory bandwidth, the denominators of MFU and MBU.

On a CUDA GPU they come from a table of datasheet figures looked up by the device's name (as
NVML and torch report it): dense BF16/FP16 tensor-core FLOP/s (no 2:4 sparsity) and memory
bandwidth; sources in docs/metrics.md. With tensor parallelism a job has tensor_parallel_size
GPUs, so its peaks are the table's times that. On the CPU there is no datasheet to trust: a
short probe (stats/probe.py: a matmul and a large copy, about a second) measures them once per
machine, thread count and dtype, cached in ~/.cache/batchgen/peaks.json ($XDG_CACHE_HOME); it
runs on rank 0's share of the cores, so a tensor-parallel job's peaks are its times the ranks.
`--peak-tflops` / `--peak-bandwidth-gbs` override either; BATCHGEN_NO_PEAK_PROBE=1 skips the
probe (MFU and MBU are then left out where no peak is known).

A cached figure is only as good as the moment it was measured: each entry keeps when
(`measured_unix`) and the load average then (`loadavg`, `cpus`), `peak_source` states its age
and that load, and the probe runs again when the entry is older than MAX_AGE_DAYS (or of an
older batchgen, without a date), or was measured under load (1-minute load average above half
the cores: a neighbour's work read 24 GFLOP/s against 180 quiet) while the machine is quiet now
and an hour has passed (so a busy machine does not probe at every run).

The cache is only a shortcut: one that is not a JSON object of entries holding both figures as
plausible positive numbers (a hand edit, a half-written file from an old batchgen) is treated
as absent, so the probe runs again and rewrites it atomically. Given peaks are never looked up.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.data.atomic import write_atomic
from batchgen.errors import OutputError

log = logging.getLogger(__name__)

# (words of the device name, all of which must appear; TFLOP/s dense bf16; GB/s; label).
# The first match wins, so the more specific names come first.
GPU_PEAKS: tuple[tuple[tuple[str, ...], float, float, str], ...] = (
    (("H200",), 989.0, 4800.0, "NVIDIA H200 SXM"),
    (("H100", "PCIE"), 756.0, 2000.0, "NVIDIA H100 PCIe"),
    (("H100", "NVL"), 835.0, 3900.0, "NVIDIA H100 NVL"),
    (("H100",), 989.0, 3350.0, "NVIDIA H100 SXM"),
    (("A100", "80GB", "PCIE"), 312.0, 1935.0, "NVIDIA A100 80GB PCIe"),
    (("A100", "80GB"), 312.0, 2039.0, "NVIDIA A100 80GB SXM"),
    (("A100",), 312.0, 1555.0, "NVIDIA A100 40GB"),
    (("L40S",), 362.0, 864.0, "NVIDIA L40S"),
    (("A10G",), 70.0, 600.0, "NVIDIA A10G"),
    (("L4",), 121.0, 300.0, "NVIDIA L4"),
    (("RTX 4090",), 165.2, 1008.0, "NVIDIA GeForce RTX 4090"),
)
NO_PROBE_ENV = "BATCHGEN_NO_PEAK_PROBE"
# What a CPU's probe can plausibly measure (FLOP/s; bytes/s): anything outside is not a
# measurement (an MFU of 441,309,057 came from a cached flops of a few hundred).
CPU_FLOPS_RANGE = (1e7, 1e16)
CPU_BANDWIDTH_RANGE = (1e7, 1e14)
MAX_AGE_DAYS = 30  # a cached probe older than this is measured again
UNDER_LOAD = "measured under load"  # in a probe's source: its peaks are not figures
RETRY_LOADED_S = 3600  # a probe taken under load is retried after this, on a quiet machine


@dataclass(frozen=True, slots=True)
class Peaks:
    flops: float | None  # FLOP/s the job's devices can do together
    bandwidth: float | None  # bytes/s of their memory together
    source: str  # where each came from, for stats.json

    @property
    def under_load(self) -> bool:
        """A CPU probe taken while other processes held the cores: its peaks read low, so an
        MFU or MBU over them reads high (a guess, not a figure)."""
        return UNDER_LOAD in self.source

    def to_dict(self) -> dict:
        return {
            "peak_flops": self.flops,
            "peak_bandwidth": self.bandwidth,
            "peak_source": self.source,
            "peak_under_load": self.under_load,
        }


def utilisation_text(stats: dict) -> str:
    """MFU / MBU of a run's stats.json values as the run's table prints them: none over peaks
    probed under load (they read low, so MFU would read high), only why."""
    if stats.get("peak_under_load"):
        return (
            "- / - (the CPU peaks were probed under load, so these would read high; pass "
            "--peak-tflops and --peak-bandwidth-gbs)"
        )
    pct = [f"{stats[k]:.2%}" if stats.get(k) is not None else "-" for k in ("mfu", "mbu")]
    return f"{pct[0]} / {pct[1]} (peaks: {stats['peak_source']})"


def gpu_peaks(name: str) -> tuple[float, float, str] | None:
    """(FLOP/s, bytes/s, label) of a GPU by its device name, or None if not in the table."""
    upper = name.upper()
    for keys, tflops, gbs, label in GPU_PEAKS:  # whole words: an L40 is not an L4
        if all(re.search(rf"\b{re.escape(k)}\b", upper) for k in keys):
            return tflops * 1e12, gbs * 1e9, label
    return None


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "batchgen" / "peaks.json"


def _load() -> tuple[float | None, int]:
    """The 1-minute load average (None where unknown) and the number of CPUs."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return load, os.cpu_count() or 1


def _loaded(load: object, cpus: object) -> bool:
    return isinstance(load, (int, float)) and isinstance(cpus, int) and load > cpus / 2


def _stale(entry: dict, now: float) -> str | None:
    """Why a usable cached entry should be measured again, or None to keep it."""
    when = entry.get("measured_unix")
    if not isinstance(when, (int, float)):
        return "it has no date (an older batchgen's)"
    if now - when > MAX_AGE_DAYS * 86400:
        return f"it is older than {MAX_AGE_DAYS} days"
    if _loaded(entry.get("loadavg"), entry.get("cpus")) and now - when > RETRY_LOADED_S:
        load, cpus = _load()
        if load is not None and not _loaded(load, cpus):
            return "it was measured under load and the machine is quiet now"
    return None


def _describe(entry: dict, now: float) -> str:
    """A cached entry's age and the load it was measured under, for peak_source."""
    when, load, cpus = entry.get("measured_unix"), entry.get("loadavg"), entry.get("cpus")
    if not isinstance(when, (int, float)):
        return "measured at an unknown date"
    age = (now - when) / 86400
    text = f"measured {time.strftime('%Y-%m-%d', time.gmtime(when))}, {age:.1f} days ago"
    return text + _load_text(load, cpus)


def _load_text(load: object, cpus: object) -> str:
    if not isinstance(load, (int, float)):
        return ""
    text = f", load average {load:.2f} on {cpus} CPUs"
    if _loaded(load, cpus):
        text += f": {UNDER_LOAD}, may read low (delete the cache or pass the peaks)"
    return text


def cpu_peaks(dtype: torch.dtype) -> tuple[float, float, str] | None:
    """The CPU's measured (FLOP/s, bytes/s, source), from the cache or a probe; None when
    the probe is switched off and nothing usable is cached."""
    from batchgen.stats.probe import measure

    key = f"{platform.node()}|{platform.machine()}|threads={torch.get_num_threads()}|{dtype}"
    path = _cache_file()
    cache = _read_cache(path)
    hit = _cached_peaks(cache.get(key))
    now = time.time()
    probe_off = bool(os.environ.get(NO_PROBE_ENV))
    if hit is not None:
        why = None if probe_off else _stale(cache[key], now)
        if why is None:
            return *hit, f"probe (cached in {path}; {_describe(cache[key], now)})"
        log.info("measuring the peaks in %s again: %s", path, why)
    elif key in cache:
        log.warning("ignoring the unusable cached peaks %r in %s; probing again", key, path)
    if probe_off:
        return None
    load, cpus = _load()
    c = measure("cpu", dtype, copy_bytes=128 << 20, matmul_n=1024, reps=3)
    cache[key] = {**c.to_dict(), "measured_unix": now, "loadavg": load, "cpus": cpus}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(
            path.parent, path.name, lambda f: f.write(json.dumps(cache, indent=2).encode())
        )
    except (OSError, OutputError) as e:  # a read-only home: measure again next time
        log.warning("cannot cache the peak probe in %s: %s", path, e)
    return c.matmul_flops, c.bandwidth_Bps, f"probe (measured now{_load_text(load, cpus)})"


def _read_cache(path: Path) -> dict:
    """The cache's entries by key; {} when it is missing, unreadable or not a JSON object."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cache, dict):
        log.warning("ignoring %s: not a JSON object of cached peaks; probing again", path)
        return {}
    return cache


def _cached_peaks(entry: object) -> tuple[float, float] | None:
    """An entry's (FLOP/s, bytes/s) when both are numbers a CPU can measure, else None (a
    missing key, a string, NaN, infinity, zero or a negative value all land outside)."""
    if not isinstance(entry, dict):
        return None
    flops, bw = entry.get("matmul_flops"), entry.get("bandwidth_Bps")
    if not all(type(v) in (int, float) for v in (flops, bw)):  # bool is not a measurement
        return None
    lo, hi = CPU_FLOPS_RANGE
    blo, bhi = CPU_BANDWIDTH_RANGE
    if lo <= flops <= hi and blo <= bw <= bhi:  # False for NaN; ints compare without overflow
        return float(flops), float(bw)
    return None


def resolve_peaks(
    device: torch.device,
    dtype: torch.dtype,
    tflops: float | None = None,
    bandwidth_gbs: float | None = None,
    tensor_parallel_size: int = 1,
) -> Peaks:
    """The job's peaks: the given ones, else the GPU table's, else the CPU probe's; with
    tensor parallelism, times tensor_parallel_size (the model's FLOPs and bytes are summed
    over the ranks, and the probe measures one rank's threads)."""
    flops = tflops * 1e12 if tflops else None
    bw = bandwidth_gbs * 1e9 if bandwidth_gbs else None
    given = "--peak-tflops/--peak-bandwidth-gbs"
    if flops and bw:
        return Peaks(flops, bw, given)
    found, where = None, "unknown"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peaks(name)
        if found is not None:
            size = tensor_parallel_size
            found = (found[0] * size, found[1] * size, f"table: {found[2]} x {size}")
        else:
            where = f"unknown GPU {name!r}: pass --peak-tflops and --peak-bandwidth-gbs"
    else:
        found = cpu_peaks(dtype)
        size = tensor_parallel_size
        if found is not None and size > 1:
            found = (found[0] * size, found[1] * size, f"{found[2]} x {size} ranks")
    if found is not None:
        where = found[2]
    source = where if not (flops or bw) else f"{given} and {where}"
    return Peaks(
        flops or (found[0] if found else None), bw or (found[1] if found else None), source
    )
