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

# OpenMP's threads wait for work passively, not spinning: a core busy with another process
# otherwise stalls every parallel region (job/threads.py has the figures). Read by OpenMP when
# torch loads it, so set before anything imports torch; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
