"""Greedy float32 generation equals transformers' generate, token for token, in a batch of
prompts of different lengths: eager for every family, and compiled (slow) for every family."""

import pytest
import torch
import transformers
from tiny_models import FAMILIES
from torch._dynamo.utils import counters

from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.planner import BucketConfig

PROMPT_LENS = [3, 11, 6, 17, 1]
MAX_NEW = 12


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' batched generate with left padding, per-row outputs up to EOS."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad,
    )[:, width:]
    eos = hf.generation_config.eos_token_id
    rows = []
    for r in out.tolist():
        rows.append(r[: r.index(eos) + 1] if eos in r else r)
    return rows


@pytest.fixture(scope="module")
def references(tiny_dirs):
    return {f: hf_greedy(tiny_dirs[f], _prompts(), MAX_NEW) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_eager(family, tiny_dirs, references):
    llm = LLM(tiny_dirs[family], dtype="float32", device="cpu", compile=False,
              buckets=BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=4))  # fmt: skip
    got = llm.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))
    assert [c.token_ids for c in got] == references[family]


# One bucket edge (32) and one batch size (8) for all five prompts: each family compiles
# exactly one prefill and one decode graph.
COMPILED_BUCKETS = BucketConfig(max_prompt_len=32, min_bucket=32, max_batch=8)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_compiled(family, tiny_dirs, references):
    graphs_before = counters["stats"]["unique_graphs"]
    llm = LLM(tiny_dirs[family], dtype="float32", device="cpu", compile=True,
              buckets=COMPILED_BUCKETS)  # fmt: skip
    got = llm.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))
    assert [c.token_ids for c in got] == references[family]
    assert llm.runner.stats.shapes == {("prefill", 8, 32, True), ("decode", 8, 48, 48, True)}
    # really compiled: two new dynamo graphs, not a silent eager fallback
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
