"""GPU utilisation and memory sampled from NVML in a background thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class GpuSamples:
    name: str = ""
    util_pct: list[int] = field(default_factory=list)
    mem_used_bytes: list[int] = field(default_factory=list)
    mem_total_bytes: int = 0

    def summary(self) -> dict:
        n = len(self.util_pct)
        return {
            "gpu_name": self.name,
            "gpu_samples": n,
            "gpu_util_mean_pct": sum(self.util_pct) / n if n else None,
            "gpu_util_max_pct": max(self.util_pct, default=None),
            "gpu_mem_used_max_bytes": max(self.mem_used_bytes, default=None),
            "gpu_mem_total_bytes": self.mem_total_bytes,
        }


class NvmlSampler:
    """Samples one GPU every `interval` seconds between start() and stop().

    Does nothing (samples stays None) where NVML or the GPU is unavailable, so the run
    goes on without GPU statistics rather than failing.
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

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        except Exception:  # no driver, no GPU, no library: no GPU stats
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
        util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
        mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        self.samples.util_pct.append(int(util.gpu))
        self.samples.mem_used_bytes.append(int(mem.used))

    def stop(self) -> dict | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
        return self.samples.summary()
