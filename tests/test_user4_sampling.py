"""Issue 31's options, vLLM's names: stop_token_ids, min_tokens, min_p and stop_reason, through
the API and the CLI on the tiny model, against transformers' generate where it has the option."""

from __future__ import annotations

import pytest
import torch
from helpers import read_output, run_job, write_jsonl

from batchgen.api.sampling import SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.sampler import SamplingTensors, sample
from batchgen.engine.sequence import FinishReason, Request
from batchgen.engine.sequence import SamplingParams as EngineParams
from batchgen.llm import LLM

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, dtype="float32", device="cpu")


def _hf_greedy(model, ids: list[int], **kw) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), do_sample=False, **kw)
    return out[0, len(ids) :].tolist()


def test_stop_token_id_ends_the_row_out_of_its_text(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop = base.token_ids[3]
    first = base.token_ids.index(stop)
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    )[0]
    c = out.outputs[0]
    assert c.finish_reason is FinishReason.STOP and c.stop_reason == stop
    assert c.token_ids == base.token_ids[: first + 1]  # kept in the ids, as vLLM
    assert c.text == llm.detokenize(base.token_ids[:first])  # not in the text
    assert base.stop_reason is None  # length: no stop_reason


def test_min_tokens_equals_transformers_min_new_tokens(llm, model):
    """A stop token below min_tokens is suppressed (transformers: eos_token_id with
    min_new_tokens), then ends the row."""
    ids = llm.tokenizer(PROMPT)["input_ids"]
    base = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    stop = base.token_ids[2]
    sp = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop], min_tokens=6)
    got = llm.generate([ids], sp)[0].outputs[0]
    eos = [stop, *llm.engine.eos_ids]  # the model's EOS is held back too
    want = _hf_greedy(model, ids, max_new_tokens=16, min_new_tokens=6, eos_token_id=eos)
    assert got.token_ids == want
    assert len(got.token_ids) >= 6 and stop not in got.token_ids[:6]


def test_stop_strings_wait_for_min_tokens(llm, model):
    ids = llm.tokenizer(PROMPT)["input_ids"]
    base = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    stop = llm.detokenize(base.token_ids[1:2])
    assert stop.strip()
    early = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, stop=stop))[0].outputs[
        0
    ]
    assert early.stop_reason == stop and early.finish_reason is FinishReason.STOP
    want = _hf_greedy(model, ids, max_new_tokens=2, stop_strings=[stop], tokenizer=llm.tokenizer)
    assert early.token_ids == want[: len(early.token_ids)]
    late = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=16, stop=stop, min_tokens=8)
    )[0]
    c = late.outputs[0]
    assert len(c.token_ids) >= 8  # the stop string before token 8 did not end it
    assert c.token_ids[:8] == base.token_ids[:8]
    assert c.text.startswith(llm.detokenize(base.token_ids[:7])[: len(early.text) + 1])


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]] * 64)
    t = lambda v, d: torch.full((64,), v, dtype=d)  # noqa: E731
    params = SamplingTensors(
        t(1.0, torch.float32),
        t(0, torch.long),
        t(1.0, torch.float32),
        torch.arange(64),
        min_p=t(0.5, torch.float32),
        ban=torch.full((64, 8), -1),
    )
    drawn = set(sample(logits, params, torch.zeros(64, dtype=torch.long), False).tolist())
    assert drawn == {0, 1}  # p(2) / p(0) = e^-2 < 0.5: never drawn
    params.min_p = t(0.0, torch.float32)
    assert {2, 3} & set(sample(logits, params, torch.zeros(64, dtype=torch.long), False).tolist())


def test_min_p_one_is_greedy_through_the_api(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0].token_ids
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=5, min_p=1.0)
    assert llm.generate([PROMPT], sp)[0].token_ids == greedy
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(temperature=0, min_p=1.5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(temperature=0, max_tokens=4, min_tokens=5)


def test_cli_options_and_columns(llm, model, tmp_path):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop = base.token_ids[3]
    rows = [
        {"id": 0, "prompt": PROMPT},
        {"id": 1, "prompt": PROMPT, "min_tokens": 8},
        {"id": 2, "prompt": PROMPT, "stop_token_ids": [], "min_p": 0.2},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    flags = ("--max-new-tokens", 12, "--stop-token-ids", stop, "--with-token-ids")
    run_job(src, out, model, *flags, "--min-p", 0.0)
    got = {r["id"]: r for r in read_output(out).to_pylist()}
    first = base.token_ids.index(stop)
    assert got[0]["finish_reason"] == "stop" and got[0]["token_ids"] == base.token_ids[: first + 1]
    assert len(got[1]["token_ids"]) >= 8  # its min_tokens held the stop token back
    assert got[2]["finish_reason"] == "length"  # its column cleared the job's stop token
    assert "stop_reason" not in got[0]  # a column only where asked


def test_stop_reason_column(llm, model, tmp_path):
    """--with-stop-reason: the stop token id (as text) or the stop string that ended a row,
    null for a row cut at its length."""
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop_id = base.token_ids[3]
    rows = [
        {"id": 0, "prompt": PROMPT},
        {"id": 1, "prompt": PROMPT, "stop_token_ids": []},
        {"id": 2, "prompt": PROMPT, "stop_token_ids": [], "stop": [base.text[4:7]]},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    flags = ("--max-new-tokens", 12, "--stop-token-ids", stop_id, "--with-stop-reason")
    run_job(src, out, model, *flags)
    got = {r["id"]: r for r in read_output(out).to_pylist()}
    assert (got[0]["finish_reason"], got[0]["stop_reason"]) == ("stop", str(stop_id))
    assert (got[1]["finish_reason"], got[1]["stop_reason"]) == ("length", None)
    assert (got[2]["finish_reason"], got[2]["stop_reason"]) == ("stop", base.text[4:7])


@pytest.mark.slow
def test_compiled_decode_with_the_options_equals_eager(model):
    engine = EngineConfig(max_num_seqs=8, block_size=16, kv_cache_tokens=2048)
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=engine)
    ids = eager.tokenizer(PROMPT)["input_ids"]
    base = eager.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    variants = [
        EngineParams(max_new_tokens=12, stop_token_ids=(base[2],)),
        EngineParams(max_new_tokens=12, stop_token_ids=(base[2],), min_tokens=5),
        EngineParams(max_new_tokens=12, temperature=1.0, seed=3, min_p=0.1),
        EngineParams(max_new_tokens=12, temperature=0.8, seed=4, min_p=0.3, min_tokens=4),
        EngineParams(max_new_tokens=12),
    ]

    def run(llm: LLM) -> list:
        reqs = [Request(i, list(ids), p) for i, p in enumerate(variants)]
        done = sorted(
            (c for r in llm.engine.generate(reqs) for c in r.finished), key=lambda c: c.index
        )
        return [(c.token_ids, c.finish_reason, c.stop_reason) for c in done]

    want = run(eager)
    llm = LLM(model, dtype="float32", device="cpu", compile=True, engine=engine)
    assert run(llm) == want
    assert llm.runner.graph.graphs <= 1 and not llm.runner.graph.failed
    assert llm.runner.graph.sample_graphs <= 3  # greedy, sampled, filtered
