"""The Python API as a vLLM user calls it (issue 31 C): one string is one prompt, one stop
string is one stop string, vLLM's parameter names work, results are shaped like vLLM's
RequestOutput, and `chat` renders messages with the tokenizer's chat template."""

from __future__ import annotations

import logging

import pytest

import batchgen.api.sampling as api
from batchgen import LLM, RequestOutput, SamplingParams
from batchgen.engine import sequence


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, device="cpu", compile=False)


def test_one_string_is_one_prompt(llm):
    outs = llm.generate("the quick brown fox", SamplingParams(max_tokens=3))
    assert len(outs) == 1 and isinstance(outs[0], RequestOutput)
    out = outs[0]
    assert out.prompt == "the quick brown fox"
    assert len(out.outputs) == 1 and out.outputs[0].completion_tokens <= 3
    # vLLM's names, and batchgen's earlier ones on the result itself
    first = out.outputs[0]
    assert out.text == first.text and out.token_ids == first.token_ids
    assert first.finish_reason in ("stop", "length") and out.finish_reason == first.finish_reason
    assert out.prompt_token_ids == llm.tokenizer("the quick brown fox")["input_ids"]


def test_vllm_names_and_keyword(llm):
    sp = SamplingParams(
        n=3, max_tokens=4, temperature=0.9, top_p=0.95, top_k=-1, seed=7, logprobs=2
    )
    assert sp.max_new_tokens == sp.max_tokens == 4 and sp.top_k == 0 and sp.top_logprobs == 2
    outs = llm.generate(["the lazy dog", "great product"], sampling_params=sp, use_tqdm=False)
    assert [o.index for o in outs] == [0, 1]
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(len(c.logprobs) == len(c.token_ids) for c in o.outputs)
        for c in o.outputs:  # vLLM's: per token, {id: Logprob} of the token and 2 alternatives
            pairs = zip(c.token_ids, c.logprobs, strict=True)
            assert all(t in d and len(d) in (2, 3) for t, d in pairs)
    # sample 0 is what n=1 gives; the others sample on seeds of their own
    alone = llm.generate("the lazy dog", SamplingParams(max_tokens=4, temperature=0.9, seed=7))
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


def test_one_stop_string_is_one_stop_string(llm):
    assert SamplingParams(stop="the").stop == ("the",)
    greedy = {"max_tokens": 24, "temperature": 0}
    free = llm.generate("the quick brown fox", SamplingParams(ignore_eos=True, **greedy))
    text = free[0].text
    stop = next((text[i : i + 3] for i in range(1, len(text) - 3) if text[i : i + 3].strip()), None)
    if stop is None:
        pytest.skip("the tiny model wrote no text to stop on")
    out = llm.generate("the quick brown fox", SamplingParams(stop=stop, **greedy))[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop"


def test_engine_params_and_old_keyword_still_work(llm):
    params = sequence.SamplingParams(max_new_tokens=2)
    a = llm.generate(["the lazy dog"], params=params)
    b = llm.generate(["the lazy dog"], params)
    assert a[0].token_ids == b[0].token_ids and a[0].completion_tokens <= 2


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "label the sentiment: great product"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0))
    want = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(out) == 1 and out[0].prompt == want
    assert out[0].prompt_token_ids == llm.tokenizer(want, add_special_tokens=False)["input_ids"]
    two = llm.chat([messages, messages], SamplingParams(max_tokens=3, temperature=0))
    assert [o.text for o in two] == [out[0].text] * 2
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])


def test_greedy_n_warns_once_naming_temperature(llm, caplog):
    api.warn_greedy_samples.cache_clear()
    with caplog.at_level(logging.WARNING, logger="batchgen.api.sampling"):
        outs = llm.generate(["the lazy dog"] * 2, SamplingParams(n=2, max_tokens=2, temperature=0))
        llm.generate("the lazy dog", SamplingParams(n=2, max_tokens=2, temperature=0))
    warned = [r for r in caplog.records if "temperature" in r.getMessage()]
    assert len(warned) == 1 and "n > 1" in warned[0].getMessage()
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids
