"""Audit 2, item 11: what an LLM changes in the process is put back by close(): glibc malloc's
thresholds once the last CPU model closes (in a fresh process: the setting is the process's),
and torch's thread count under tensor parallelism on the CPU."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import KEPT_MIB_SOURCE

from batchgen import LLM
from batchgen.model.host_malloc import is_glibc

# How many MiB of 512 1 MiB blocks, freed last to first, glibc keeps in its heap's top: all of
# them while an LLM holds the tuning, at most its trim threshold (128 KiB) once it is back. A
# block another thread takes from the same arena meanwhile (tqdm's monitor, on a loaded
# machine) splits the top and lowers the figure, never raises it: the most of three is taken.
PROBE = (
    KEPT_MIB_SOURCE
    + """
import json, sys
from batchgen import LLM, SamplingParams

out = {}
options = dict(device="cpu", compile=False)
with LLM(sys.argv[1], **options) as llm, LLM(sys.argv[1], **options) as b:
    llm.generate("the lazy dog", SamplingParams(temperature=0, max_tokens=2))
    b.close()  # one of two closed: the other still holds the tuning
    out["open"] = max(kept_mib() for _ in range(3))
out["closed"] = max(kept_mib() for _ in range(3))
print(json.dumps(out))
"""
)


@pytest.mark.skipif(not is_glibc(), reason="glibc only")
def test_closing_the_last_cpu_llm_puts_mallocs_thresholds_back(model):
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True, check=True
    )
    kept = json.loads(r.stdout.strip().splitlines()[-1])
    assert kept["open"] >= 256 and kept["closed"] < 64, kept


def test_closing_a_tensor_parallel_llm_puts_the_thread_count_back(model):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(model, device="cpu", compile=False, tensor_parallel_size=2)
        assert torch.get_num_threads() == 1  # the cores, shared between the two ranks
        llm.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
