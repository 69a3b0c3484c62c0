"""Compiled decoding: no recompilation in steady state, and compiled == eager.

Each test compiles one prefill and one decode graph (one bucket, one batch size), so
both are marked slow; the inductor FX cache in /tmp makes reruns fast.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters

from batchgen.engine.sequence import FinishReason, SamplingParams
from batchgen.llm import LLM
from batchgen.planner import BucketConfig, plan_batches

# One prompt bucket (32), batch size 8 for any 5..8 rows, new-token bucket 16: stride 48.
BUCKETS = BucketConfig(max_prompt_len=32, min_bucket=32, max_batch=8)


def _batch(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """5-8 rows of 1-32 tokens, 1-16 new tokens, greedy and seeded sampled rows mixed."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(5, 9, (1,), generator=g))
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(1, 33, (1,), generator=g))
        prompts.append(torch.randint(2, 500, (length,), generator=g).tolist())
        max_new = int(torch.randint(1, 17, (1,), generator=g))
        temperature = 0.0 if i % 3 == 2 else 0.9
        params.append(SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                     top_k=40, top_p=0.95, seed=seed * 100 + i))  # fmt: skip
    return prompts, params


class CompileEvents:
    """Counts dynamo compilation starts while installed."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, args) -> None:
        self.n += 1

    def __enter__(self):
        callback_handler.register_start_callback(self)
        return self

    def __exit__(self, *exc) -> None:
        callback_handler.remove_start_callback(self)


def _snapshot() -> dict:
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames": dict(counters["frames"]),
        "aot_autograd": counters["aot_autograd"]["total"],
    }


@pytest.mark.slow
def test_no_recompilation_in_steady_state(tiny_dirs):
    path = tiny_dirs["llama"]
    llm = LLM(path, dtype="float32", device="cpu", compile=True,
              buckets=BUCKETS)  # fmt: skip
    eager = LLM(path, dtype="float32", device="cpu", compile=False, buckets=BUCKETS)

    with CompileEvents() as warmup:
        before = _snapshot()
        prompts, params = _batch(0)
        first = llm.generate(prompts, params)
    # the instruments see compiles: warm-up made exactly one prefill and one decode graph
    assert warmup.n >= 2
    assert _snapshot()["unique_graphs"] - before["unique_graphs"] == 2
    shapes = set(llm.runner.stats.shapes)
    assert shapes == {("prefill", 8, 32, False), ("decode", 8, 48, 48, False)}
    assert [c.token_ids for c in first] == [c.token_ids for c in eager.generate(prompts, params)]

    steady = _snapshot()
    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2, 3, 4):
            prompts, params = _batch(seed)
            # precondition: the batch maps onto the warmed-up shape
            lens, max_new = [len(p) for p in prompts], [p.max_new_tokens for p in params]
            assert plan_batches(lens, max_new, BUCKETS).shapes == {(8, 32, 16)}
            got = llm.generate(prompts, params)
            assert [c.token_ids for c in got] == [c.token_ids for c in eager.generate(prompts, params)]  # fmt: skip
            for c, p in zip(got, params, strict=True):
                assert len(c.token_ids) == p.max_new_tokens or c.finish_reason == FinishReason.STOP
    assert events.n == 0
    assert _snapshot() == steady
    assert llm.runner.stats.shapes == shapes
