"""Will a planned allocation fit? Asked before making it.

A size that comes from a setting or a config.json (a KV cache of --kv-cache-tokens, RoPE tables
of max_position_embeddings) can ask for terabytes; made anyway, it fails deep inside torch or
gets the process OOM-killed. `check_allocation` compares it with what the device has free now
and refuses it with the setting to lower. Free memory on the host is MemAvailable from
/proc/meminfo (what can be had without swapping), capped by the cgroup's limit where a
container has one; on a GPU, torch.cuda.mem_get_info. Where neither can be read, nothing is
checked.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from batchgen.errors import ConfigError


class AllocationTooLarge(ConfigError):
    pass


def check_allocation(nbytes: int, what: str, setting: str, device="cpu") -> None:
    """Raise AllocationTooLarge if `what` (nbytes) does not fit in device's free memory;
    the message names `setting` as the fix."""
    free = available_bytes(device)
    if free is None or nbytes <= free:
        return
    raise AllocationTooLarge(
        f"{what} needs {format_bytes(nbytes)}, but {device} has {format_bytes(free)} free; "
        f"lower {setting}"
    )


def available_bytes(device="cpu") -> int | None:
    """Bytes that can be allocated on device now; None where that cannot be told."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free
    if kind == "cpu":
        return host_available_bytes()
    return None


def host_available_bytes() -> int | None:
    free = _meminfo_available()
    limit = _cgroup_limit()
    if free is None:
        return limit
    return free if limit is None else min(free, limit)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of t, summing the inner tensors of quantized tensor subclasses."""
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in inner if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied ones counted once); buffers such as the
    KV cache are not weights."""
    return sum(tensor_bytes(p) for p in model.parameters())


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # not Linux: free pages (an underestimate, as it leaves out reclaimable cache)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2, then v1); None without one. The limit,
    not limit - usage: usage counts page cache the kernel would give back."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        # "max" (v2) or a huge number (v1) means no limit.
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return int(limit)
    return None
