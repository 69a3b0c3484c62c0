"""GPU utilisation, memory, memory-controller load and power sampled from NVML in a background
thread, so the engine's thread never waits on the driver.

What NVML's numbers are: `util.gpu` ("SM %" in the table) is the share of the sample period
in which at least one kernel ran, not how many SMs were busy; `util.memory` is the share in
which device memory was being read or written (the memory controller's load), not bandwidth
used; power is the board's draw in milliwatts. Each query is tried on its own: a GPU that does
not report power (some do not) still reports the rest.

Which GPU: NVML counts every GPU in the machine and ignores CUDA_VISIBLE_DEVICES (which
`--workers` sets per worker), so a torch device index is no NVML index: `cuda:0` of a worker
given GPU 3 is NVML's GPU 3. The GPU is found by its UUID, which torch and NVML share.

Tensor parallelism: one sampler in rank 0's process samples every rank's GPU (rank r runs on
`cuda:r`, parallel/rank_model.py). The summary's SM and memory-controller figures are over all
of them, memory is the fullest GPU's, power is their sum (the job's draw), and `gpus` holds
each GPU's own summary.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass(slots=True)
class GpuSamples:
    name: str = ""
    util_pct: list[int] = field(default_factory=list)
    mem_used_bytes: list[int] = field(default_factory=list)
    mem_total_bytes: int = 0
    mem_util_pct: list[int] = field(default_factory=list)  # memory controller busy
    power_mw: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "gpu_name": self.name,
            "gpu_samples": len(self.util_pct),
            "gpu_util_mean_pct": _mean(self.util_pct),
            "gpu_util_max_pct": max(self.util_pct, default=None),
            "gpu_mem_used_mean_bytes": _mean(self.mem_used_bytes),
            "gpu_mem_used_max_bytes": max(self.mem_used_bytes, default=None),
            "gpu_mem_total_bytes": self.mem_total_bytes,
            "gpu_mem_util_mean_pct": _mean(self.mem_util_pct),
            "gpu_mem_util_max_pct": max(self.mem_util_pct, default=None),
            "gpu_power_mean_w": m / 1e3 if (m := _mean(self.power_mw)) is not None else None,
            "gpu_power_max_w": max(self.power_mw) / 1e3 if self.power_mw else None,
        }


def gpu_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed table's GPU lines from a summary (nothing without samples)."""
    if d.get("gpu_util_mean_pct") is None:
        return []
    rows = [("GPU SM % mean/max", f"{d['gpu_util_mean_pct']:.0f}% / {d['gpu_util_max_pct']}%")]
    if d.get("gpu_count", 1) > 1:
        rows.insert(0, ("GPUs sampled", f"{d['gpu_count']} (memory: the fullest; power: the sum)"))
    used, total = d["gpu_mem_used_max_bytes"], d["gpu_mem_total_bytes"]
    share = f" ({used / total:.0%} of {total / 2**30:.1f} GiB)" if total else ""
    rows.append(("GPU memory max", f"{used / 2**30:.2f} GiB{share}"))
    if d.get("gpu_mem_util_mean_pct") is not None:
        mem = f"{d['gpu_mem_util_mean_pct']:.0f}% / {d['gpu_mem_util_max_pct']}%"
        rows.append(("GPU memory busy mean/max", mem))
    if d.get("gpu_power_mean_w") is not None:
        rows.append(
            ("GPU power mean/max", f"{d['gpu_power_mean_w']:.0f} W / {d['gpu_power_max_w']:.0f} W")
        )
    return rows


def nvml_uuid(device_index: int) -> str:
    """NVML's UUID ("GPU-...") of torch's CUDA device device_index (as this process sees it)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def combine(each: list[dict]) -> dict:
    """One summary over several GPUs' (a tensor-parallel job's), with each GPU's in `gpus`."""
    if len(each) == 1:
        return each[0]
    out = dict(each[0])

    def over(key: str, how) -> float | None:
        values = [d[key] for d in each if d[key] is not None]
        return how(values) if values else None

    for key in ("gpu_util_mean_pct", "gpu_mem_used_mean_bytes", "gpu_mem_util_mean_pct"):
        out[key] = over(key, _mean)
    for key in ("gpu_util_max_pct", "gpu_mem_used_max_bytes", "gpu_mem_util_max_pct"):
        out[key] = over(key, max)
    out["gpu_samples"] = min(d["gpu_samples"] for d in each)
    out["gpu_power_mean_w"] = over("gpu_power_mean_w", sum)  # the job's draw: all its GPUs'
    out["gpu_power_max_w"] = over("gpu_power_max_w", sum)
    return {**out, "gpu_count": len(each), "gpus": each}


class NvmlSampler:
    """Samples GPUs every `interval` seconds between start() and stop(): torch's
    `cuda:N` for each N in devices (counted among the visible devices; a tensor-parallel job's
    ranks' GPUs). Does nothing (samples stays empty) where NVML or a GPU is unavailable, so the
    run goes on without GPU statistics rather than failing.
    """

    def __init__(self, devices: int | Sequence[int] = 0, interval: float = 0.5) -> None:
        self.devices = [devices] if isinstance(devices, int) else list(devices)
        self.interval = interval
        self.samples: list[GpuSamples] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None

    def start(self) -> NvmlSampler:
        try:
            import pynvml  # from the nvidia-ml-py package

            uuids = [nvml_uuid(i) for i in self.devices]
            pynvml.nvmlInit()
        except Exception:  # no driver, no GPU, no library: no GPU stats
            return self
        handles = []
        try:
            for uuid in uuids:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                name = pynvml.nvmlDeviceGetName(handle)
                total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
                name = name if isinstance(name, str) else name.decode()
                handles.append((handle, GpuSamples(name=name, mem_total_bytes=total)))
        except Exception:  # initialised, but not these GPUs: let NVML go
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return self
        self._nvml = pynvml
        self.samples = [s for _, s in handles]
        self._thread = threading.Thread(target=self._loop, args=(handles,), daemon=True)
        self._thread.start()
        return self

    def _loop(self, handles: list) -> None:
        while True:
            for handle, samples in handles:
                self._sample(handle, samples)
            if self._stop.wait(self.interval):
                return

    def _sample(self, handle, s: GpuSamples) -> None:
        nvml = self._nvml
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception:  # a transient driver error: skip this sample
            return
        s.util_pct.append(int(util.gpu))
        s.mem_util_pct.append(int(util.memory))
        s.mem_used_bytes.append(int(mem.used))
        with contextlib.suppress(Exception):  # power: not supported on some boards
            s.power_mw.append(int(nvml.nvmlDeviceGetPowerUsage(handle)))

    def stop(self) -> dict | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
        return combine([s.summary() for s in self.samples])
