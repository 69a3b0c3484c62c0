"""glibc's malloc keeps freed blocks for the next step (model/host_malloc.py): a CPU model's
load sets it, and then a step-like run of allocations of a few MiB each stops faulting fresh
pages in. Checked in fresh processes (the setting is the process's) by what does not hang on
plain glibc's luck: whether 512 MiB of 1 MiB blocks freed at once stays in the heap's top
(mallinfo2's keepcost; plain glibc trims a top above its threshold, at most 64 MiB), and the
steps' page faults against the pages they allocate. Plain glibc's own fault count is no
oracle: its mmap and trim thresholds move with what was freed before, so the same probe
faults 5k or 250k pages by heap layout, thread count and transparent huge pages (CI saw the
first, this machine the second)."""

import json
import os
import subprocess
import sys

import pytest
from helpers import KEPT_MIB_SOURCE

from batchgen.model.host_malloc import MALLOC_TUNING_ENV, is_glibc

pytestmark = pytest.mark.skipif(not is_glibc(), reason="glibc only")

STEP_MIB = (12, 24, 6, 3, 12)  # a prefill step's activations, each with one half its size
STEPS = 20
KEPT_MIB = 256  # of 512 1 MiB blocks freed at once: a heap that keeps them, not one that trims
FRESH_PAGES = STEPS * sum(mb + mb / 2 for mb in STEP_MIB) * (1 << 20) / 4096

# Frees and allocates as a prefill step's layers do; prints the minor page faults of STEPS such
# steps after one warm-up, then how many MiB of 512 1 MiB blocks, freed last to first, the heap
# keeps in its top.
PROBE = f"""
import json, resource, sys
import torch
from batchgen.model.host_malloc import keep_freed_memory

how = sys.argv[1]
tuned = None
if how == "call":
    tuned = keep_freed_memory()
elif how == "load":
    from batchgen.llm import LLM
    LLM(sys.argv[2], device="cpu", dtype="float32")

def step():
    for mb in {STEP_MIB}:
        x = torch.ones(mb << 18)
        y = torch.ones((mb << 18) // 2)
        del x

faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
before = faults()
for _ in range({STEPS}):
    step()
faulted = faults() - before
{KEPT_MIB_SOURCE}
print(json.dumps({{"faults": faulted, "kept_mib": kept_mib(), "tuned": tuned}}))
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
    assert tuned["kept_mib"] >= KEPT_MIB  # the 512 MiB freed stays in the heap's top
    assert plain["kept_mib"] < KEPT_MIB  # glibc trims a top above its threshold (<= 64 MiB)
    # the steps reuse freed blocks: under a tenth of the pages they allocate are faulted in
    assert tuned["faults"] < FRESH_PAGES / 10


def test_the_switch_leaves_malloc_as_it_is():
    off = _probe("call", off=True)
    assert off["tuned"] is False
    assert off["kept_mib"] < KEPT_MIB


def test_loading_a_cpu_model_keeps_freed_memory(model):
    loaded = _probe("load", str(model))
    off = _probe("load", str(model), off=True)
    assert loaded["kept_mib"] >= KEPT_MIB
    assert loaded["faults"] < FRESH_PAGES / 10
    assert off["kept_mib"] < KEPT_MIB
