"""glibc's malloc keeps freed blocks for the next step (model/host_malloc.py): a CPU model's
load sets it, and then a step-like run of allocations of a few MiB each stops faulting fresh
pages in. Counted in fresh processes (the setting is the process's), in page faults, not time.
Each probe turns transparent huge pages off for itself: where the kernel's THP is "always", a
fault maps 2 MiB or 4 KiB by what memory is free at the time, and the counts say nothing."""

import json
import os
import subprocess
import sys

import pytest

from batchgen.model.host_malloc import MALLOC_TUNING_ENV, is_glibc

pytestmark = pytest.mark.skipif(not is_glibc(), reason="glibc only")

# Frees and allocates activations of 3-24 MiB as a prefill step's layers do; prints the
# minor page faults of 20 such steps after one warm-up.
PROBE = """
import ctypes, json, resource, sys
assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0  # PR_SET_THP_DISABLE: 4 KiB faults
import torch
from batchgen.model.host_malloc import keep_freed_memory

how = sys.argv[1]
if how == "call":
    tuned = keep_freed_memory()
elif how == "load":
    from batchgen.llm import LLM
    LLM(sys.argv[2], device="cpu", dtype="float32")
    tuned = None

def step():
    for mb in (12, 24, 6, 3, 12):
        x = torch.ones(mb << 18)
        y = torch.ones((mb << 18) // 2)
        del x

faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
before = faults()
for _ in range(20):
    step()
print(json.dumps({"faults": faults() - before, "tuned": tuned if how == "call" else None}))
"""


def _probe(*args: str, off: bool = False) -> dict:
    env = {**os.environ, MALLOC_TUNING_ENV: "0" if off else "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_freed_memory_stops_the_page_faults_of_each_step():
    plain = _probe("none")
    tuned = _probe("call")
    assert tuned["tuned"] is True
    # plain glibc: each 12-24 MiB block is a fresh mapping (~3000-6000 faults a step)
    assert plain["faults"] > 20 * 3000
    assert tuned["faults"] < plain["faults"] / 5


def test_the_switch_leaves_malloc_as_it_is():
    off = _probe("call", off=True)
    assert off["tuned"] is False
    assert off["faults"] > 20 * 3000


def test_loading_a_cpu_model_keeps_freed_memory(model):
    loaded = _probe("load", str(model))
    off = _probe("load", str(model), off=True)
    assert loaded["faults"] < off["faults"] / 5
