"""batchgen: offline batch LLM inference on a paged KV cache with continuous batching.

from batchgen import LLM, SamplingParams
llm = LLM("path/to/model")            # a local save_pretrained directory
outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, stop="\n"))
outs[0].outputs[0].text               # as vLLM's RequestOutput; llm.chat(messages) too

from batchgen import RunConfig, run   # what `batchgen run` does
run(RunConfig(input="prompts.parquet", output="out/"))
"""

import os
from typing import Any

# OpenMP's threads spin 0.1 ms for the next parallel region, then sleep (its default spins
# 3 ms; passive waits cost a quiet machine ~20%: job/threads.py has the figures), and a job's
# thread governor gives up the CPUs other processes keep busy. Read by OpenMP when torch loads
# it, so set before anything imports torch; a wait policy or spin count the user set is kept.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from batchgen.api.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.api.sampling import SamplingParams
from batchgen.engine.sequence import Completion, FinishReason
from batchgen.job.config import RunConfig

__all__ = [
    "LLM",
    "Completion",
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "RequestOutput",
    "RunConfig",
    "SamplingParams",
    "run",
]


def run(config: RunConfig):
    """Run one job (see `batchgen run --help`); returns its RunStats."""
    from batchgen.runner.run import run as _run

    return _run(config)


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; importing it lazily keeps `batchgen merge`/`slurm` and the
    # plain-Python scheduler quick to start.
    if name == "LLM":
        from batchgen.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
