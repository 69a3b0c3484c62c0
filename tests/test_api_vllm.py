"""Issue 38: the Python API as vLLM's. Unseeded samples are independent (item 6), `score` is
not vLLM's and says so (item 7), a failed, interrupted or concurrent call leaves the LLM
working (item 19), LLM takes vLLM's engine arguments, SamplingParams has vLLM's defaults and
outputs vLLM's logprobs, and prompts that cannot run raise."""

from __future__ import annotations

import threading

import pytest

from batchgen import LLM, Logprob, SamplingParams
from batchgen.engine.params import DecodeParams
from batchgen.errors import ConfigError, RequestError

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, device="cpu", compile=False)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def _texts(outs) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in outs]


# ---------------------------------------------------------------- item 6: seeds


def test_unseeded_requests_sample_independently(llm):
    outs = llm.generate([PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=8))
    assert len(set(_texts(outs))) > 1  # the old seed 0 for all: one text four times
    again = llm.generate([PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=8))
    assert _texts(again) != _texts(outs)  # and not the same on the next call


def test_seeded_requests_stay_reproducible(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    first = _texts(llm.generate([PROMPT] * 3, sp))
    assert len(set(first)) == 1 and _texts(llm.generate(PROMPT, sp)) == first[:1]


def test_the_llm_seed_makes_a_script_rerun_alike(model):
    sp = SamplingParams(temperature=1.0, max_tokens=6)
    runs = []
    for _ in range(2):
        with LLM(model, device="cpu", seed=5) as llm:
            runs.append(_texts(llm.generate([PROMPT] * 3, sp)))
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


# ---------------------------------------------------------------- item 7: candidate_logprobs


def test_score_is_refused_naming_candidate_logprobs(llm):
    with pytest.raises(RequestError, match=r"cross-encoder.*candidate_logprobs"):
        llm.score("one prompt", [" yes", " no"])


def test_one_prompt_string_is_one_prompt(llm):
    (c,) = llm.candidate_logprobs("one prompt", [" yes", " no"])
    assert len(c.scores) == 2 and all(s < 0 for s in c.scores)
    (same,) = llm.candidate_logprobs(["one prompt"], [[" yes", " no"]])
    assert same.scores == pytest.approx(c.scores)


@pytest.mark.parametrize(
    ("prompts", "candidates", "says"),
    [
        ("", [" yes"], "prompt 0 is empty"),
        ("one prompt", [], "no candidates"),
        ("one prompt", [""], "candidate 0 of prompt 0 is empty"),
        ("one prompt", [[10**6]], "not in the model's vocabulary"),
        (["a", "b"], [[" yes"]], "1 candidate lists for 2 prompts"),
    ],
)
def test_candidates_that_cannot_run_are_refused(llm, prompts, candidates, says):
    with pytest.raises(RequestError, match=says):
        llm.candidate_logprobs(prompts, candidates)
    assert len(llm.candidate_logprobs("one prompt", [" yes"])[0].scores) == 1


# ---------------------------------------------------------------- item 19: state after failure


def _in_flight(llm) -> int:
    sched = llm.engine.scheduler
    return len(sched.waiting) + len(sched.running) + llm.engine.completions.scoring_in_flight


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_failed_call_leaves_nothing_behind(model, monkeypatch, error):
    llm = LLM(model, device="cpu", max_num_seqs=2)
    want = _texts(llm.generate(["a b c", "the cat"], _greedy(max_tokens=6, ignore_eos=True)))
    execute, calls = llm.runner.execute, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise error("stopped inside a step")
        return execute(*a, **kw)

    monkeypatch.setattr(llm.runner, "execute", failing)
    with pytest.raises(error):
        llm.generate([PROMPT] * 5, _greedy(max_tokens=12, ignore_eos=True))
    assert _in_flight(llm) == 0
    pool = llm.engine.scheduler.pool
    assert pool.num_free == pool.num_usable  # every block given back
    got = llm.generate(["a b c", "the cat"], _greedy(max_tokens=6, ignore_eos=True))
    assert _texts(got) == want  # not the interrupted call's completions


def test_two_threads_share_one_llm(llm):
    sp = _greedy(max_tokens=8, ignore_eos=True)
    prompts = {0: ["a b c", "the cat"], 1: [PROMPT, "hello there", "x"]}
    want = {k: _texts(llm.generate(p, sp)) for k, p in prompts.items()}
    got, errors, start = {}, [], threading.Barrier(2)

    def call(k: int) -> None:
        start.wait()
        try:
            got[k] = _texts(llm.generate(prompts[k], sp))
        except Exception as e:  # noted, so the assertion names it
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == want


def test_top_k_past_int64_is_refused_where_given():
    for make in (SamplingParams, DecodeParams):
        with pytest.raises(ValueError, match=r"top_k must be in \[0, 2\*\*63\)"):
            make(top_k=10**20)


def test_an_out_of_vocabulary_stop_id_with_min_tokens_fails_its_row_only(llm):
    """The engine's own params (the command line's rows): an error row, no index error."""
    bad = DecodeParams(max_new_tokens=4, stop_token_ids=(10**6,), min_tokens=2)
    out = llm.generate([PROMPT, PROMPT], [bad, DecodeParams(max_new_tokens=2)])
    assert out[0].outputs[0].finish_reason == "error"
    assert "stop_token_ids token id 1000000" in out[0].outputs[0].error
    assert out[1].outputs[0].finish_reason == "length" and _in_flight(llm) == 0


# ---------------------------------------------------------------- vLLM's LLM(...) arguments


def test_llm_takes_vllm_engine_arguments(model):
    llm = LLM(
        model,
        device="cpu",
        max_model_len=64,
        max_num_seqs=3,
        max_num_batched_tokens=96,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        seed=1,
        tensor_parallel_size=1,
        dtype="float",
        quantization=None,
    )
    cfg = llm.config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefix_caching) == (3, 96, False)
    assert cfg.gpu_memory_utilization == 0.5 and llm.compile is False
    assert llm.max_model_len == 64 and str(llm.dtype) == "torch.float32"
    assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(RequestError, match="maximum model length of 64"):
        llm.generate([list(range(1, 65))])
    # an output stops at max_model_len, as vLLM's does
    (out,) = llm.generate([list(range(1, 61))], _greedy(max_tokens=16, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_unknown_engine_arguments_are_refused_naming_the_class(model):
    class MyLLM(LLM):
        pass

    with pytest.raises(ConfigError, match=r"MyLLM\(\) got an unknown argument 'swap_space'"):
        MyLLM(model, swap_space=4)
    with pytest.raises(ConfigError, match="awq"):
        LLM(model, quantization="awq")
    with pytest.raises(ConfigError, match="more than the model's 256 positions"):
        LLM(model, max_model_len=10**6)
    with pytest.raises(ConfigError, match="contradict"):
        LLM(model, enforce_eager=True, compile=True)
    with pytest.raises(ConfigError, match="not both"):
        LLM(model, engine={"block_size": 8}, max_num_seqs=2)


def test_builtin_default_model():
    with LLM("builtin:default-model", device="cpu") as llm:
        (out,) = llm.generate("Hello", _greedy(max_tokens=3))
    assert out.outputs[0].completion_tokens <= 3


# ---------------------------------------------------------------- SamplingParams as vLLM's


def test_sampling_params_defaults_are_vllm_s():
    sp = SamplingParams()
    assert (sp.temperature, sp.max_tokens, sp.n, sp.logprobs) == (1.0, 16, 1, None)
    assert sp.random_seed and not SamplingParams(seed=3).random_seed


def test_logprobs_are_vllm_s_list_of_dicts(llm):
    (out,) = llm.generate(PROMPT, _greedy(max_tokens=5, logprobs=2, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    for tok, d in zip(c.token_ids, c.logprobs, strict=True):
        assert all(isinstance(v, Logprob) for v in d.values())
        assert d[tok].rank == 1  # greedy: the likeliest, its own first alternative
        assert len(d) == 2 and max(v.logprob for v in d.values()) == d[tok].logprob
        assert d[tok].decoded_token == llm.tokenizer.decode([tok])
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True))
    )
    (plain,) = llm.generate(PROMPT, _greedy(max_tokens=5, ignore_eos=True))
    assert plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob == pytest.approx(c.cumulative_logprob)
    (zero,) = llm.generate(PROMPT, _greedy(max_tokens=5, logprobs=0, ignore_eos=True))
    assert [list(d) for d in zero.outputs[0].logprobs] == [[t] for t in c.token_ids]


def test_skip_special_tokens_and_stop_strings_in_output(llm):
    eos = llm.engine.eos_ids[0]
    sp = {"max_tokens": 3, "ignore_eos": True, "logit_bias": {eos: 100}}
    (skip,) = llm.generate(PROMPT, _greedy(**sp))
    (keep,) = llm.generate(PROMPT, _greedy(skip_special_tokens=False, **sp))
    assert skip.outputs[0].token_ids == [eos] * 3 and skip.outputs[0].text == ""
    assert keep.outputs[0].text == llm.tokenizer.decode([eos] * 3) != ""
    (free,) = llm.generate(PROMPT, _greedy(max_tokens=24, ignore_eos=True))
    text = free.outputs[0].text
    stop = next((text[i : i + 3] for i in range(1, len(text) - 3) if text[i : i + 3].strip()), None)
    if stop is None:
        pytest.skip("the tiny model wrote no text to stop on")
    (cut,) = llm.generate(PROMPT, _greedy(max_tokens=24, stop=stop))
    (kept,) = llm.generate(
        PROMPT, _greedy(max_tokens=24, stop=stop, include_stop_str_in_output=True)
    )
    assert kept.outputs[0].text == cut.outputs[0].text + stop == text[: text.index(stop) + 3]


def test_chat_takes_a_template_and_its_arguments(llm):
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ extra }}"
    (out,) = llm.chat(
        messages,
        _greedy(max_tokens=2),
        chat_template=template,
        add_generation_prompt=False,
        chat_template_kwargs={"extra": "!"},
    )
    assert out.prompt == "<user>hi!"
    (default,) = llm.chat(messages, _greedy(max_tokens=2), add_generation_prompt=False)
    assert default.prompt == llm.tokenizer.apply_chat_template(messages, tokenize=False)
