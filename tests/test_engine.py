"""The engine end to end on tiny real models.

Greedy float32 output equals transformers' generate token for token, for every family,
whatever the scheduler does to the rows: chunked prefill, preemption and recompute,
prefix-cache hits. A seeded sampled row draws the same tokens alone, in a batch and
after being preempted. Every request comes back exactly once; one that cannot fit comes
back as an error completion while the others run.
"""

import random

import pytest
import torch
from test_exactness import hf_greedy
from tiny_models import FAMILIES

from batchgen.engine.config import EngineConfig
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import FinishReason, Request, SamplingParams, StepReport
from batchgen.engine.step_inputs import width_groups
from batchgen.llm import LLM

# Rows of 1-25 tokens, finishing after 1-12 new tokens (or at EOS), so sequences join and
# leave the running batch at different steps.
LENS = [3, 11, 6, 17, 1, 25, 9]
MAX_NEW = [5, 12, 3, 12, 1, 12, 8]
PARAMS = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
PREFIX_LEN = 13  # shared by the prefixed prompts: 3 blocks of 4

MODELS = (*FAMILIES, "mistral-window4")
ENGINES = {
    "default": EngineConfig(),
    # 5 tokens a step: prompts are prefilled in chunks next to running decodes
    "chunked": EngineConfig(max_num_batched_tokens=5),
    # 10 usable blocks of 4 for rows that need up to 10 each: the newest are preempted
    "preempted": EngineConfig(block_size=4, kv_cache_tokens=44),
    "all": EngineConfig(max_num_seqs=3, max_num_batched_tokens=5, block_size=4, kv_cache_tokens=44),
}


def _prompts(seed: int = 0, lens=LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lens]


def _prefixed() -> list[list[int]]:
    (prefix,) = _prompts(7, [PREFIX_LEN])
    return [prefix + p for p in _prompts(1)]


def _llm(path, engine: EngineConfig | None = None, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", compile=False, engine=engine, **kw)


@pytest.fixture(scope="module")
def dirs(sharp_dirs):
    """The sharpened models: with near-uniform attention a wrong scale or mask can hide."""
    return sharp_dirs


@pytest.fixture(scope="module")
def references(dirs):
    """transformers' greedy rows for the plain and the prefixed prompts, per model."""
    return {
        m: (
            hf_greedy(dirs[m], _prompts(), max(MAX_NEW)),
            hf_greedy(dirs[m], _prefixed(), max(MAX_NEW)),
        )
        for m in MODELS
    }


@pytest.fixture
def plans(monkeypatch) -> list[dict]:
    """What every step the runner executes ran: (request, start, tokens, samples) per
    scheduled sequence, the step's token count, and who was preempted."""
    seen = []
    execute = ModelRunner.execute

    def spy(self, plan, bitmask=None):
        seen.append(
            dict(
                decodes=[(s.seq.request.index, s.start, 1) for s in plan.decodes],
                prefills=[
                    (s.seq.request.index, s.start, s.num_tokens, s.samples) for s in plan.prefills
                ],
                num_tokens=plan.num_tokens,
                preempted=[seq.request.index for seq in plan.preempted],
            )
        )
        return execute(self, plan, bitmask)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    return seen


@pytest.fixture
def preempted(monkeypatch) -> list:
    """Every sequence the scheduler preempts, in order."""
    seen = []
    preempt = Scheduler.preempt

    def spy(self, seq):
        seen.append(seq)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "preempt", spy)
    return seen


def _assert_equal_rows(got, ref, max_new=MAX_NEW):
    for i, m in enumerate(max_new):
        assert got[i].index == i and got[i].error is None
        assert got[i].token_ids == ref[i][:m], f"row {i}"
        stopped = ref[i][:m][-1:] == [1]  # the tiny models' EOS
        assert got[i].finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)
        assert len(got[i].logprobs) == len(got[i].token_ids)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", MODELS)
def test_greedy_equals_transformers(model, engine, dirs, references, plans):
    cfg = ENGINES[engine]
    llm = _llm(dirs[model], cfg)
    got = llm.generate(_prompts(), PARAMS)
    _assert_equal_rows(got, references[model][0])
    sched = llm.engine.scheduler
    assert all(p["num_tokens"] <= cfg.max_num_batched_tokens for p in plans)
    chunked = any(not s[3] for p in plans for s in p["prefills"])
    assert chunked == (cfg.max_num_batched_tokens < max(LENS))
    assert (sched.num_preemptions > 0) == (cfg.kv_cache_tokens is not None)
    assert sched.num_preemptions == sum(len(p["preempted"]) for p in plans)
    if engine == "all":  # the rows also met in a step: decodes next to a prefill chunk
        assert any(p["decodes"] and p["prefills"] for p in plans)
    assert sched.pool.num_free == sched.pool.num_usable  # every block given back


@pytest.mark.parametrize("model", MODELS)
def test_prefix_cache_hits_equal_transformers(model, dirs, references, plans):
    # Two sequences at a time: later rows are admitted after the shared prefix is cached.
    llm = _llm(dirs[model], EngineConfig(max_num_seqs=2, block_size=4))
    prompts = _prefixed()
    ref = references[model][1]
    got = llm.generate(prompts, PARAMS)
    _assert_equal_rows(got, ref)
    pool = llm.engine.scheduler.pool
    assert pool.hits > 0
    assert sum(c.cached_tokens > 0 for c in got) >= len(prompts) - 2  # all but the first two
    assert all(c.cached_tokens % 4 == 0 and c.cached_tokens < c.prompt_tokens for c in got)
    hit_starts = [s[1] for p in plans for s in p["prefills"] if s[1] > 0]
    assert hit_starts and all(s % 4 == 0 for s in hit_starts)
    # the same rows again on the same engine: their prompts come from the cache
    again = llm.generate(prompts, PARAMS)
    _assert_equal_rows(again, ref)
    assert all(c.cached_tokens >= 12 for c in again)


def test_a_second_generate_reuses_every_full_prompt_block(dirs, references):
    llm = _llm(dirs["llama"], EngineConfig(block_size=4))
    first = llm.generate(_prompts(), PARAMS)
    assert all(c.cached_tokens == 0 for c in first)
    again = llm.generate(_prompts(), PARAMS)
    _assert_equal_rows(again, references["llama"][0])
    # every full block but the one holding a prompt's last token (computed, to sample)
    assert [c.cached_tokens for c in again] == [4 * ((n - 1) // 4) for n in LENS]
    off = _llm(dirs["llama"], EngineConfig(block_size=4, prefix_caching=False))
    off.generate(_prompts(), PARAMS)
    again = off.generate(_prompts(), PARAMS)
    _assert_equal_rows(again, references["llama"][0])
    assert all(c.cached_tokens == 0 for c in again) and off.engine.scheduler.pool.hits == 0


SEEDED = SamplingParams(
    max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True
)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_seeded_row_same_alone_in_a_batch_and_after_preemption(model, dirs, preempted):
    path = dirs[model]
    (prompt,) = _prompts(3, [2])
    (alone,) = _llm(path).generate([prompt], SEEDED)
    assert len(alone.token_ids) == 16
    (greedy,) = _llm(path).generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert alone.token_ids != greedy.token_ids  # it really sampled

    # neighbours with longer prompts, greedy or sampled with other seeds and settings
    neighbours = _prompts(4, [9, 14, 20, 6])
    params = [
        SamplingParams(max_new_tokens=16, ignore_eos=True),
        SamplingParams(max_new_tokens=16, temperature=1.3, seed=7, ignore_eos=True),
        SamplingParams(
            max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=1235, ignore_eos=True
        ),
        SamplingParams(max_new_tokens=16, temperature=0.5, top_p=0.5, seed=1234, ignore_eos=True),
    ]
    rows, row_params = (
        [*neighbours[:2], prompt, *neighbours[2:]],
        [*params[:2], SEEDED, *params[2:]],
    )
    batch = _llm(path).generate(rows, row_params)
    assert batch[2].token_ids == alone.token_ids

    # 9 blocks of 4 for rows of up to 36 tokens: the shortest prompt, admitted last, is
    # the newest sequence and the first preempted
    tight = _llm(path, EngineConfig(block_size=4, kv_cache_tokens=40)).generate(rows, row_params)
    assert 2 in [seq.request.index for seq in preempted]
    assert tight[2].token_ids == alone.token_ids
    assert [c.token_ids for c in tight] == [c.token_ids for c in batch]
    assert tight[2].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_stop_strings_and_eos_are_unchanged_by_scheduling(dirs):
    """Rows that stop at a stop string or EOS come out the same whether they ran together
    with defaults or were chunked, preempted and cached."""
    base = _llm(dirs["llama"])
    prompts = _prompts(2)
    free = base.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    # each even row stops at the text of its 6th token (found again later or not)
    params = [
        SamplingParams(
            max_new_tokens=MAX_NEW[i] + 8,
            stop=(base.detokenize(c.token_ids[5:6]),) if i % 2 == 0 else (),
        )
        for i, c in enumerate(free)
    ]
    want = base.generate(prompts, params)
    assert sum(c.finish_reason == FinishReason.STOP for c in want) >= 3
    # 12 usable blocks of 4 for rows of up to 45 tokens (12 blocks), 5 tokens a step
    tight = _llm(
        dirs["llama"],
        EngineConfig(max_num_seqs=3, max_num_batched_tokens=5, block_size=4, kv_cache_tokens=52),
    )
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]


def test_a_request_that_cannot_fit_is_an_error_completion(dirs):
    # 4 blocks of 16, one of them scratch: 48 tokens for a row
    llm = _llm(dirs["llama"], EngineConfig(kv_cache_tokens=64))
    ok = _prompts(5, [7, 30, 3])
    too_big, too_long = _prompts(6, [40, 250])
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (8, 18, 12, 8, 10)]
    got = llm.generate([ok[0], ok[1], too_big, ok[2], too_long], params)
    assert [c.index for c in got] == [0, 1, 2, 3, 4]
    assert got[2].finish_reason == FinishReason.ERROR and got[2].token_ids == []
    assert "exceeds the KV cache's 48 tokens" in got[2].error and got[2].prompt_tokens == 40
    assert got[4].finish_reason == FinishReason.ERROR
    assert "exceeds the model's 256 positions" in got[4].error
    for i, p, sp in ((0, ok[0], params[0]), (1, ok[1], params[1]), (3, ok[2], params[3])):
        assert got[i].error is None and len(got[i].token_ids) == sp.max_new_tokens
        assert got[i].token_ids == _llm(dirs["llama"]).generate([p], sp)[0].token_ids


def test_step_reports_return_each_request_once_as_it_finishes(dirs):
    llm = _llm(dirs["qwen3"])
    lens = [3, 11, 6, 17, 1, 25, 9]
    reqs = [
        Request(i, p, SamplingParams(max_new_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(zip(_prompts(0, lens), MAX_NEW, strict=True))
    ]
    reports = list(llm.engine.generate(reqs))
    assert all(isinstance(r, StepReport) for r in reports)
    done = [c for r in reports for c in r.finished]
    assert sorted(c.index for c in done) == list(range(len(reqs)))  # each exactly once
    assert all(len(c.token_ids) == reqs[c.index].params.max_new_tokens for c in done)
    assert sum(bool(r.finished) for r in reports) >= 4  # rows came back as they finished
    assert done[0].index == 4  # row 4 (1 new token) is the first to finish
    # accounting: every prompt token computed once, every later token a decode row
    assert sum(r.prompt_tokens for r in reports) == sum(lens)
    assert sum(r.decode_rows for r in reports) == sum(MAX_NEW) - len(reqs)
    assert sum(r.cached_tokens for r in reports) == 0 and sum(r.preempted for r in reports) == 0
    assert all(r.padded_rows == 0 and r.compile_seconds == 0 for r in reports)  # eager
    assert any(r.prefill for r in reports) and any(not r.prefill for r in reports)
    # and the engine takes more work afterwards, on the same pool
    more = list(llm.engine.generate(reqs[:2]))
    assert sorted(c.index for r in more for c in r.finished) == [0, 1]


def test_a_one_token_prompt_chunk_counts_as_prompt_work(dirs):
    llm = _llm(dirs["llama"], EngineConfig(max_num_batched_tokens=4))
    reqs = [
        Request(0, [5], SamplingParams(max_new_tokens=3, ignore_eos=True)),
        Request(1, list(range(2, 11)), SamplingParams(max_new_tokens=3, ignore_eos=True)),
    ]
    reports = list(llm.engine.generate(reqs))
    assert sum(r.prompt_tokens for r in reports) == 1 + 9
    assert sum(r.decode_rows for r in reports) == 2 * (3 - 1)


def test_generate_keeps_order_and_takes_text_or_ids(dirs):
    llm = _llm(dirs["gpt2"])
    assert llm.generate([], SamplingParams()) == []
    texts = ["the quick brown fox", "label the sentiment"]
    ids = [llm.tokenizer(t)["input_ids"] for t in texts]
    a = llm.generate(texts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    b = llm.generate(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.prompt_tokens for c in a] == [len(i) for i in ids]
    assert [c.text for c in a] == [llm.detokenize(c.token_ids) for c in a]


@pytest.mark.parametrize("seed", range(10))
def test_decode_width_groups_cover_the_batch_in_order(seed):
    """The runner attends decodes in at most 4 groups of similar table width (widths
    sorted longest first); a group's rows are at least 0.6 x its widest, unless the
    group limit merged them into the last group."""
    rng = random.Random(seed)
    widths = sorted((rng.randint(1, 64) for _ in range(rng.randint(0, 40))), reverse=True)
    groups = width_groups(widths)
    assert [i for lo, hi in groups for i in range(lo, hi)] == list(range(len(widths)))
    assert len(groups) <= 4 and all(hi > lo for lo, hi in groups)
    tight = groups if len(groups) < 4 else groups[:-1]
    assert all(widths[hi - 1] >= 0.6 * widths[lo] for lo, hi in tight)


def test_samples_of_one_prompt_admitted_together_compute_it_once(dirs, plans):
    """Four sampled copies of a 41-token prompt arrive together: the first computes it, the
    others wait one step for its blocks and compute only the last, partial block's token."""
    llm = _llm(dirs["llama"], EngineConfig(block_size=4))
    (prompt,) = _prompts(9, [41])
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s) for s in range(4)]
    got = llm.generate([prompt] * 4, params)
    prompt_tokens = sum(s[2] for p in plans for s in p["prefills"])
    assert prompt_tokens == 41 + 3 * 1
    assert [c.cached_tokens for c in got] == [0, 40, 40, 40]
    assert len({tuple(c.token_ids) for c in got}) > 1  # still sampled independently
