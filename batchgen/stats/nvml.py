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
"""

from __future__ import annotations

import contextlib
import threading
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


class NvmlSampler:
    """Samples one GPU every `interval` seconds between start() and stop().

    device_index is torch's (`cuda:N`, counted among the visible devices). Does nothing
    (samples stays None) where NVML or the GPU is unavailable, so the run goes on without GPU
    statistics rather than failing.
    """

    def __init__(self, device_index: int = 0, interval: float = 0.5) -> None:
        self.device_index = device_index
        self.interval = interval
        self.samples: GpuSamples | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None

    def start(self) -> NvmlSampler:
        try:
            import pynvml  # from the nvidia-ml-py package

            uuid = nvml_uuid(self.device_index)
            pynvml.nvmlInit()
        except Exception:  # no driver, no GPU, no library: no GPU stats
            return self
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        except Exception:  # initialised, but not this GPU: let NVML go
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return self
        self._nvml = pynvml
        self.samples = GpuSamples(
            name=name if isinstance(name, str) else name.decode(), mem_total_bytes=total
        )
        self._thread = threading.Thread(target=self._loop, args=(handle,), daemon=True)
        self._thread.start()
        return self

    def _loop(self, handle) -> None:
        while True:
            self._sample(handle)
            if self._stop.wait(self.interval):
                return

    def _sample(self, handle) -> None:
        nvml, s = self._nvml, self.samples
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
        return self.samples.summary()
