"""Tensor parallelism with real ranks: 2 processes over gloo on the CPU (this test process is
rank 0 and starts rank 1), against the same engine on one process.

All-reduce changes the order of a sum, so greedy outputs may part where two tokens nearly tie:
each family must give the one-process tokens on at least 90% of the rows, and every row that
parts must part at a near-tie (the one-process model's top two logits within 1e-4)."""

import pytest
import torch
import transformers

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import (
    Constraint,
    ConstraintKind,
    FinishReason,
    Request,
    SamplingParams,
)
from batchgen.llm import LLM

# Prompts of 3 to 60 tokens, generated lengths of 4 to 20: a mixed batch.
PROMPTS = [[2 + (7 * i + 3 * j) % 500 for j in range(3 + (13 * i) % 58)] for i in range(16)]
GREEDY = [SamplingParams(max_new_tokens=4 + (5 * i) % 17, ignore_eos=True) for i in range(16)]
ENGINE = EngineConfig(max_num_seqs=8, kv_cache_tokens=4096)


def _assert_tp_matches(model_dir, ref, out, prompts=PROMPTS):
    """>= 90% of rows equal; each row that differs parts at a near-tie of the reference."""
    differ = [i for i, (a, b) in enumerate(zip(ref, out, strict=True)) if a != b]
    assert len(differ) <= 0.1 * len(ref), f"rows {differ} differ"
    if not differ:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for i in differ:
        j = next(k for k, (a, b) in enumerate(zip(ref[i], out[i], strict=False)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompts[i] + ref[i][:j]])).logits[0, -1]
        top = logits.topk(2).values
        assert top[0] - top[1] < 1e-4, f"row {i} parts at token {j}, gap {top[0] - top[1]}"


@pytest.mark.parametrize(
    "family", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "llama-1-kv-head"]
)
def test_two_ranks_give_one_rank_tokens(tiny_dirs, one_kv_head, family):
    d = one_kv_head if family == "llama-1-kv-head" else tiny_dirs[family]
    ref = [c.token_ids for c in LLM(d, device="cpu", engine=ENGINE).generate(PROMPTS, GREEDY)]
    with LLM(d, device="cpu", engine=ENGINE, tensor_parallel_size=2) as llm:
        out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        assert llm.weights_bytes_per_rank < 0.6 * LLM(d, device="cpu").weights_bytes_per_rank
    _assert_tp_matches(d, ref, out)


def test_lora_at_two_ranks(model, tmp_path):
    import peft

    hf = transformers.AutoModelForCausalLM.from_pretrained(model)
    torch.manual_seed(0)
    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(hf, config).save_pretrained(tmp_path / "adapter")
    lora = dict(device="cpu", engine=ENGINE, lora=str(tmp_path / "adapter"))
    ref = [c.token_ids for c in LLM(model, **lora).generate(PROMPTS, GREEDY)]
    base = [c.token_ids for c in LLM(model, device="cpu", engine=ENGINE).generate(PROMPTS, GREEDY)]
    with LLM(model, tensor_parallel_size=2, **lora) as llm:
        out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    assert ref != base  # the adapter changes the outputs
    assert sum(a == b for a, b in zip(ref, out, strict=True)) >= 0.9 * len(ref)


# One engine config that exercises the features below at once: 24-token steps (prompts are
# prefilled in chunks) over a pool of 14 usable blocks, smaller than the rows in flight need
# (sequences are preempted and recomputed), with prefix caching on.
TIGHT = EngineConfig(max_num_seqs=6, max_num_batched_tokens=24, kv_cache_tokens=15 * 16)


@pytest.fixture(scope="module")
def pair(model):
    """A one-process engine and a two-rank engine of the tiny Llama, same config."""
    with LLM(model, device="cpu", engine=TIGHT, tensor_parallel_size=2) as tp:
        yield LLM(model, device="cpu", engine=TIGHT), tp


def _reports(llm, requests):
    done, reports = {}, []
    for r in llm.engine.generate(requests):
        reports.append(r)
        done.update((c.index, c) for c in r.finished)
    return [done[i] for i in range(len(requests))], reports


def test_chunked_prefill_preemption_and_prefix_caching(model, pair):
    shared = PROMPTS[4][:40]  # a 40-token preamble: two full blocks every row can hit
    prompts = [shared + p[:12] for p in PROMPTS[:10]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    runs = [_reports(llm, [Request(i, p, params) for i, p in enumerate(prompts)]) for llm in pair]
    (ref, _), (out, reports) = runs
    assert sum(r.preempted for r in reports) > 0
    assert sum(r.cached_tokens for r in reports) >= 32 * 8  # most rows hit the preamble
    assert max(r.prompt_tokens for r in reports) <= 24 and any(r.prefill for r in reports)
    _assert_tp_matches(model, [c.token_ids for c in ref], [c.token_ids for c in out], prompts)


def test_constraints_scores_samples_and_row_seeds(model, pair):
    choice = Constraint(ConstraintKind.CHOICE, (" yes", " no", " maybe"))
    constrained = SamplingParams(max_new_tokens=8, constraint=choice)
    sampled = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3, 1)]
    results = []
    for llm in pair:
        c = llm.generate(PROMPTS[:6], constrained)
        s = llm.generate([PROMPTS[3]] * 4, sampled)  # one prompt, four seeds (two alike)
        sc = llm.candidate_logprobs(PROMPTS[:4], [" yes", " no"])
        results.append((c, s, sc))
    (c1, s1, sc1), (c2, s2, sc2) = results
    assert [c.text for c in c2] == [c.text for c in c1]
    assert all(c.text in choice.spec and c.finish_reason is FinishReason.STOP for c in c2)
    assert [c.token_ids for c in s2] == [c.token_ids for c in s1]
    assert s2[0].token_ids == s2[3].token_ids != s2[1].token_ids  # seeds, not batch, decide
    for a, b in zip(sc1, sc2, strict=True):
        torch.testing.assert_close(
            torch.tensor(b.scores), torch.tensor(a.scores), atol=1e-4, rtol=0
        )


def test_penalties_and_a_bias_past_the_first_ranks_vocabulary(model, pair):
    """Each rank holds half the vocabulary, the sampling row all of it (issue 38, item 20): a
    logit_bias on the last token id is taken, and the penalties count tokens of either half."""
    vocab = pair[0].spec.model_cfg.vocab_size
    forced = SamplingParams(max_new_tokens=3, ignore_eos=True, logit_bias={vocab - 1: 100})
    penalized = SamplingParams(
        max_new_tokens=12,
        ignore_eos=True,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={vocab - 2: 5},  # a token of the second half in most rows' output
    )
    runs = [(llm.generate(PROMPTS[:6], forced), llm.generate(PROMPTS, penalized)) for llm in pair]
    (f1, p1), (f2, p2) = runs
    assert all(c.token_ids == [vocab - 1] * 3 for c in f1 + f2)
    assert sum(any(t >= vocab // 2 for t in c.token_ids) for c in p1) >= len(PROMPTS) // 2
    _assert_tp_matches(model, [c.token_ids for c in p1], [c.token_ids for c in p2])
