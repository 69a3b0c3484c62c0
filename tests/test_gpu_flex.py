"""The CUDA decode path, FlexAttention reading the paged pool in place, on a GPU: it is the
default there, and it gives the gather path's tokens (float32) eagerly under preemption,
prefix-cache hits and a sliding window, and compiled as a CUDA graph with no recompiles.
scripts/gpu_check.sh runs these (step `flex`, `pytest -m gpu tests/test_gpu_flex.py`); without
CUDA, conftest.py skips them. tests/test_flex_attention.py checks the same on the CPU.

Eager steps compile flex once a (rows, table width) bucket, so the workloads keep both few:
at most 4 rows at a time, tables of at most 4 blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers import graph_launches
from tiny_models import save_tiny_model

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.attention.step import DECODE_ATTENTION_ENV, DecodeBackend

pytestmark = pytest.mark.gpu

# head_dim 32: the flex kernel needs >= 16 (the tiny models' default is 8)
MODEL_KW = dict(hidden_size=128, intermediate_size=256, initializer_range=0.2)
# 4 rows at a time, 16-token blocks, 8 usable blocks for rows that need up to 4: preemption
TIGHT = EngineConfig(max_num_seqs=4, block_size=16, kv_cache_tokens=144)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("flex")
    return {
        "llama": save_tiny_model("llama", root / "llama", **MODEL_KW),
        "mistral": save_tiny_model("mistral", root / "mistral", sliding_window=20, **MODEL_KW),
    }


def _rows() -> list[list[int]]:
    """6 rows of 5-30 tokens, 3 of them after a shared 16-token prefix (one full block)."""
    g = torch.Generator().manual_seed(0)
    plain = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 30, 12)]
    prefix = torch.randint(2, 500, (16,), generator=g).tolist()
    return plain + [prefix + r[:14] for r in plain]


def _generate(path, backend: str | None, monkeypatch, engine=TIGHT, compile=False):
    if backend is None:
        monkeypatch.delenv(DECODE_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_ATTENTION_ENV, backend)
    llm = LLM(path, dtype="float32", device="cuda", compile=compile, engine=engine)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    return llm, llm.generate(_rows(), params)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_flex_is_cudas_path_and_gives_the_gather_tokens(dirs, family, monkeypatch):
    _, want = _generate(dirs[family], "gather", monkeypatch)
    llm, got = _generate(dirs[family], None, monkeypatch)
    assert llm.runner.attention is DecodeBackend.FLEX  # the default on CUDA
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.pool.hits > 0
    for a, b in zip(got, want, strict=True):
        assert a.error is None and a.token_ids == b.token_ids, f"row {a.index}"
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=2e-3)


def test_compiled_flex_decode_is_one_cuda_graph_with_no_recompiles(dirs, monkeypatch):
    """4 rows decoding together, a table growing from 1 to 2 blocks: one decode graph (flex's
    block lists have a fixed width), CUDA-graphed, the block mask an input of it; a second pass
    compiles nothing and gives the same tokens."""
    from torch._dynamo.utils import counters

    engine = EngineConfig(max_num_seqs=4, block_size=64, kv_cache_tokens=1024)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 9, 14, 60)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "gather")
    eager = LLM(dirs["llama"], dtype="float32", device="cuda", compile=False, engine=engine)
    want = [c.token_ids for c in eager.generate(rows, params)]
    monkeypatch.delenv(DECODE_ATTENTION_ENV)
    counters.clear()
    llm = LLM(dirs["llama"], dtype="float32", device="cuda", compile=True, engine=engine)
    assert llm.runner.attention is DecodeBackend.FLEX
    assert [c.token_ids for c in llm.generate(rows, params)] == want
    assert 4 in llm.runner.shapes  # 4 rows decoding: 4 tokens, a CUDA-graph size
    decode = llm.runner.graph  # one symbolic graph, flex an opaque op inside it
    assert not decode.failed and decode.graphs <= 1
    graphs = counters["stats"]["unique_graphs"]

    def again():
        with torch._dynamo.config.patch(error_on_recompile=True):
            again.out = [c.token_ids for c in llm.generate(rows, params)]

    # piecewise CUDA graphs around the flex op: 2 launches a step at least (eager: none)
    assert graph_launches(again) >= 2 * 16  # a prefill step and 15 decode steps
    assert again.out == want
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_the_backends_compiled_flex_decode_equals_its_gather(model_type, tmp_path, monkeypatch):
    """The transformers backend on CUDA's path, compiled: sinks from the kernel's log-sum-exp
    (inductor's CPU template has none, so this runs only here), a soft-cap as a score_mod."""
    from tiny_hf_models import save_tiny_hf_model

    path = save_tiny_hf_model(model_type, tmp_path / model_type)
    engine = EngineConfig(max_num_seqs=4, block_size=16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "gather")
    eager = LLM(path, dtype="float32", device="cuda", compile=False, engine=engine)
    want = [c.token_ids for c in eager.generate(_rows(), params)]
    monkeypatch.delenv(DECODE_ATTENTION_ENV)
    llm = LLM(path, dtype="float32", device="cuda", compile=True, engine=engine)
    assert llm.runner.attention is DecodeBackend.FLEX
    assert [c.token_ids for c in llm.generate(_rows(), params)] == want
