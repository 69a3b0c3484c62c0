"""The machine's ceilings, measured: memory bandwidth from a large tensor copy (bytes read +
written over the time) and the matrix-multiply rate from a large matmul on random data in the
model's dtype, each the fastest of a few repetitions (a ceiling is the best the machine did;
on a shared machine the median mostly measures the neighbours). Datasheet rates are only
leads on a CPU, so batchgen measures there (stats/peaks.py caches the result per machine);
scripts/roofline.py prints the same figures for any device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


def call_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    """Seconds of each of reps calls of fn (CUDA: by events, so the GPU's time)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _timed(fn: Callable[[], None], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Fastest of reps timed calls of fn, after warmup calls."""
    for _ in range(warmup):
        fn()
    return min(call_seconds(fn, device, reps))


def _copy_seconds(n: int, device: torch.device, reps: int) -> float:
    src = torch.randn(n, device=device)  # random, never zeros (they can run faster)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, reps)
    if not torch.equal(dst[-1024:], src[-1024:]):
        raise RuntimeError("the bandwidth probe's copy did not write its output")
    return seconds


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return _timed(lambda: torch.mm(a, b), device, reps)


@dataclass(slots=True)
class Ceilings:
    device: str
    dtype: str
    bandwidth_Bps: float  # bytes read + written per second, large copy
    matmul_flops: float  # FLOP/s of an n x n x n matmul in dtype
    copy_bytes: int
    matmul_n: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure(
    device: str | torch.device,
    dtype: torch.dtype,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    reps: int = 10,
) -> Ceilings:
    """Measure both ceilings; sizes default to well past the caches of each device type."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if cuda else 256 << 20)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    n = copy_bytes // 4
    copy_s = _copy_seconds(n, device, reps)
    mm_s = _matmul_seconds(matmul_n, dtype, device, reps if cuda else 3)
    if cuda:
        torch.cuda.empty_cache()
    return Ceilings(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        bandwidth_Bps=2 * n * 4 / copy_s,
        matmul_flops=2 * matmul_n**3 / mm_s,
        copy_bytes=n * 4,
        matmul_n=matmul_n,
    )
