"""The reference: transformers' greedy generate, token for token, on the sharpened tiny models
(peaked attention: on them a model missing a feature fails, test_exactness_controls.py). Here
the eager engine on a mixed batch of every family and the compiled engine (slow); every
scheduling mode is compared in test_engine.py.

hf_greedy, _prompts and MAX_NEW are imported from here by other tests.
"""

import pytest
from helpers import cpu_llm, hf_greedy, random_prompts
from tiny_models import FAMILIES
from torch._dynamo.utils import counters

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams

PROMPT_LENS = [3, 11, 6, 17, 1]
MAX_NEW = 12
MODELS = (*FAMILIES, "mistral-window4")


def _prompts(seed: int = 0) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, seed)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_matches_transformers_eager(model, sharp_dirs):
    llm = cpu_llm(sharp_dirs[model])
    got = llm.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))
    want = hf_greedy(sharp_dirs[model], _prompts(), MAX_NEW)
    assert [c.token_ids for c in got] == want
    # a live reference: most rows are not one token repeated (as GPT-2's are, unsharpened)
    assert sum(len(set(row)) > 2 for row in want) > len(want) // 2, want


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_compiled(family, sharp_dirs):
    graphs_before = counters["stats"]["unique_graphs"]
    # rows of up to 29 tokens: decode batches of 1-8 rows over tables of 1-2 blocks
    llm = cpu_llm(sharp_dirs[family], compile=True, engine=EngineConfig(block_size=16))
    got = llm.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))
    assert [c.token_ids for c in got] == hf_greedy(sharp_dirs[family], _prompts(), MAX_NEW)
    # every step compiled, prefills and decodes (the token counts met), not a silent eager
    # fallback: one symbolic graph of the model for every step, and the warm-up's three
    # sampling graphs (greedy, sampled, filtered)
    assert len(llm.runner.shapes) > 3
    decode = llm.runner.graph
    assert decode.graphs <= 1 and not decode.failed  # 0: an earlier engine compiled it
    assert counters["stats"]["unique_graphs"] - graphs_before <= 4  # sampling's: shared
