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
"""

from __future__ import annotations

import ctypes
import os
import platform

MALLOC_TUNING_ENV = "BATCHGEN_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int


def is_glibc() -> bool:
    """Whether this process's malloc is glibc's (Linux with glibc): what the tuning applies to."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Set this process's malloc to reuse freed blocks up to 32 MiB instead of returning them
    to the kernel. True if it was set (glibc on Linux, not switched off)."""
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0" or not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1 and ok
