"""glibc's malloc told to keep freed memory for the next step (the CPU's tensors live there).

torch's CPU allocator is malloc. glibc serves a block above its mmap threshold (128 KiB at
start, raised on the fly up to 32 MiB as such blocks are freed) with a fresh mmap, and hands
the top of its heap back to the kernel once more than its trim threshold is free there. An
engine step allocates and frees the same activations, a few MiB each, in every layer, so many
came back as fresh pages to fault in and zero: the mixed benchmark job took ~600k minor page
faults. With the mmap threshold fixed at its 32 MiB maximum and no trimming, freed blocks serve
the next ones: ~240k faults, prefill steps 1.1-1.3x faster, the same peak RSS
(docs/benchmarks.md); 1.03-1.05x where transparent huge pages are "always" and a fault maps
up to 2 MiB, each still zeroed. vLLM's CPU guide gets the same from tcmalloc through
LD_PRELOAD; this needs nothing installed. The KV pool and the weights (above 32 MiB) keep their
own mappings. BATCHGEN_MALLOC_TUNING=0 leaves malloc as it is.

The setting is the process's, so a program that loads an `LLM` and goes on would keep it (after
an LLM was closed, a caller's 1.2 GB freed stayed resident: 1551 MiB against 274 MiB). Each
loaded CPU model holds it (`keep_freed_memory`), and when the last one lets go
(`release_freed_memory`, from `LLM.close()`) the thresholds go back to glibc's starting values
(128 KiB, or what MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set) and the kept memory is
trimmed. What glibc cannot give back: any mallopt of these thresholds turns off its sliding
mmap threshold for the rest of the process; BATCHGEN_MALLOC_TUNING=0 leaves it untouched.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

MALLOC_TUNING_ENV = "BATCHGEN_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int
_GLIBC_START = 128 << 10  # both thresholds' values at start (DEFAULT_MMAP/TRIM_THRESHOLD)


class _Holders:
    """How many loaded models hold the tuning: one count for the process, as the setting is."""

    lock = threading.Lock()
    count = 0


def is_glibc() -> bool:
    """Whether this process's malloc is glibc's (Linux with glibc): what the tuning applies to."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Set this process's malloc to reuse freed blocks up to 32 MiB instead of returning them
    to the kernel. True if it was set (glibc on Linux, not switched off): the caller then holds
    it and calls `release_freed_memory` when done."""
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0" or not is_glibc():
        return False
    with _Holders.lock:
        if _Holders.count == 0 and not _set(_MMAP_THRESHOLD_MAX, _NEVER_TRIM):
            return False
        _Holders.count += 1
        return True


def release_freed_memory() -> None:
    """One holder of `keep_freed_memory` is done; the last one puts glibc's starting thresholds
    back and hands the kept memory to the kernel."""
    with _Holders.lock:
        if _Holders.count == 0:
            return
        _Holders.count -= 1
        if _Holders.count == 0:
            _set(_env_int("MALLOC_MMAP_THRESHOLD_"), _env_int("MALLOC_TRIM_THRESHOLD_"))
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def trim() -> None:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim, which also
    releases whole free pages inside the heap, not only at its top). A load's transients are
    freed among the weights kept after them, so without it their pages stay resident: an INT4
    load packs each layer and trims (model/checkpoint/stored_linears.py)."""
    if is_glibc():
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok


def _env_int(name: str) -> int:
    """glibc's own start value of a threshold: its environment variable's, or the default."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return _GLIBC_START
