"""Audit 2, item 11: what an LLM changes in the process is put back by close(): glibc malloc's
thresholds once the last CPU model closes (in a fresh process: the setting is the process's),
and torch's thread count under tensor parallelism on the CPU."""

import json
import subprocess
import sys

import pytest
import torch

from batchgen import LLM
from batchgen.model.host_malloc import is_glibc

# Pages faulted in when 512 MiB of 1 MiB blocks is written, freed and written again: while an
# LLM holds the tuning the second round reuses the first's freed memory (~none), once it is back
# each block is a fresh mmap to fault in (all 131,072 pages). Faults, not the heap top's size
# (mallinfo2's keepcost): a model's run leaves free chunks inside the heap, which the blocks may
# reuse, so the top may grow by a fraction of them (55 MiB in two loaded full runs).
PROBE = """
import ctypes, json, resource, sys
from batchgen import LLM, SamplingParams

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def write_and_free():
    blocks = [libc.malloc(1 << 20) for _ in range(512)]
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    for block in reversed(blocks):
        libc.free(block)


def refaults():
    write_and_free()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    write_and_free()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


out = {}
options = dict(device="cpu", compile=False)
with LLM(sys.argv[1], **options) as llm, LLM(sys.argv[1], **options) as b:
    llm.generate("the lazy dog", SamplingParams(temperature=0, max_tokens=2))
    b.close()  # one of two closed: the other still holds the tuning
    out["open"] = refaults()
out["closed"] = refaults()
print(json.dumps(out))
"""
PAGES = 512 * (1 << 20) // 4096


@pytest.mark.skipif(not is_glibc(), reason="glibc only")
def test_closing_the_last_cpu_llm_puts_mallocs_thresholds_back(model):
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True, check=True
    )
    kept = json.loads(r.stdout.strip().splitlines()[-1])
    assert kept["open"] < PAGES // 10 and kept["closed"] > PAGES // 2, kept


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
