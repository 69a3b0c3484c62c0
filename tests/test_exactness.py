"""The reference: transformers' greedy generate. Eager engine runs are compared with it in
test_engine.py (every family, every scheduling mode); here the compiled engine is (slow).
"""

import pytest
import torch
import transformers
from tiny_models import FAMILIES
from torch._dynamo.utils import counters

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.engine.step_inputs import next_pow2
from batchgen.llm import LLM

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


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_compiled(family, tiny_dirs):
    graphs_before = counters["stats"]["unique_graphs"]
    # rows of up to 29 tokens: decode batches of 1-8 rows over tables of 1-2 blocks
    llm = LLM(
        tiny_dirs[family],
        dtype="float32",
        device="cpu",
        compile=True,
        engine=EngineConfig(block_size=16),
    )
    got = llm.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))
    assert [c.token_ids for c in got] == hf_greedy(tiny_dirs[family], _prompts(), MAX_NEW)
    shapes = llm.runner.shapes
    assert shapes and all(k[0] == "decode" and k[3] and not k[4] for k in shapes)  # greedy, no mask
    assert all(b == next_pow2(b) <= 8 and w == next_pow2(w) for _, b, w, *_ in shapes)
    # really compiled: one new dynamo graph per shape, not a silent eager fallback
    assert counters["stats"]["unique_graphs"] - graphs_before == len(shapes)
