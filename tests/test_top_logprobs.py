"""Each generated token's likeliest alternatives (SamplingParams.top_logprobs): computed in the
same step as the token, from the same distribution, only for the rows that ask, without
changing any row's output; compiled decoding gives what eager does."""

import dataclasses

import pytest

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM

ENGINE = EngineConfig(max_num_seqs=4, block_size=16, kv_cache_tokens=512)
PROMPTS = [[5, 9, 33, 7], [100, 200, 300], [42] * 9, [7, 8]]


def _params(top: int) -> list[SamplingParams]:
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True, top_logprobs=top)
    sampled = dataclasses.replace(greedy, temperature=0.9, seed=3)
    return [greedy, sampled, dataclasses.replace(greedy, top_logprobs=0), sampled]


def _check(done, plain):
    for i, (c, p) in enumerate(zip(done, plain, strict=True)):
        assert c.token_ids == p.token_ids  # asking changes no output
        if i == 2:
            assert c.top_logprobs is None
            continue
        assert len(c.top_logprobs) == len(c.token_ids)
        for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert len(top) == 4
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and values[0] <= 0
            if i == 0:  # greedy: the likeliest is the token taken
                assert top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-5)
            if tok in dict(top):  # a sampled token among them: its own logprob
                assert dict(top)[tok] == pytest.approx(lp, abs=1e-5)
            else:
                assert lp <= values[-1] + 1e-5


def test_top_logprobs_only_where_asked(model):
    llm = LLM(model, dtype="float32", device="cpu", compile=False, engine=ENGINE)
    _check(llm.generate(PROMPTS, _params(4)), llm.generate(PROMPTS, _params(0)))


@pytest.mark.slow
def test_compiled_top_logprobs_equal_eager(model):
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=ENGINE)
    compiled = LLM(model, dtype="float32", device="cpu", compile=True, engine=ENGINE)
    want, got = eager.generate(PROMPTS, _params(4)), compiled.generate(PROMPTS, _params(4))
    _check(got, eager.generate(PROMPTS, _params(0)))
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.top_logprobs or [], w.top_logprobs or [], strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)
    assert compiled.runner.graph.graphs <= 1  # the alternatives are sampling's, not a guard
