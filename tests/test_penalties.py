"""vLLM's repetition_penalty, presence_penalty, frequency_penalty and logit_bias
(engine/penalties.py): greedy repetition penalty equal to transformers' generate token for
token in a batch where other rows have none, presence / frequency against a pure-Python
reference over the produced tokens, logit_bias banning and forcing tokens, the same under
preemption, prefix caching and n samples, the compiled sampling path equal to eager with no
extra graph, and the options through the API, the command line and OpenAI batch bodies."""

import json
from collections import Counter

import pytest
import torch
import transformers
from helpers import (
    assert_one_line_error,
    hf_greedy,
    random_prompts,
    read_job,
    read_output,
    run_job,
    write_jsonl,
    write_parquet,
)

from batchgen.api.sampling import SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.params import logit_bias_pairs
from batchgen.llm import LLM

LENS = [3, 11, 6, 17, 1, 9]
MAX_NEW = 16
# 10 usable blocks of 4 for rows of up to 33 tokens: the newest rows are preempted
PREEMPTED = EngineConfig(block_size=4, kv_cache_tokens=44)


def _llm(path, engine: EngineConfig | None = None, compile: bool = False) -> LLM:
    return LLM(path, dtype="float32", device="cpu", compile=compile, engine=engine)


@pytest.fixture(scope="module")
def sharp(sharp_dirs):
    return sharp_dirs["llama"]


def _mixed(**penalty) -> list[SamplingParams]:
    """Every other row penalized, the rest plain."""
    plain = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    return [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, **penalty) if i % 2 == 0 else plain
        for i in range(len(LENS))
    ]


def _hf_rows(model_dir, prompts, params: list[SamplingParams]) -> list[list[int]]:
    """transformers' greedy rows, one call a row (no padding tokens for the penalty to see)."""
    return [
        hf_greedy(model_dir, [p], MAX_NEW, repetition_penalty=sp.repetition_penalty)[0]
        for p, sp in zip(prompts, params, strict=True)
    ]


@pytest.mark.parametrize("engine", [None, PREEMPTED], ids=["default", "preempted"])
def test_greedy_repetition_penalty_equals_transformers(sharp, engine):
    prompts, params = random_prompts(LENS), _mixed(repetition_penalty=1.5)
    llm = _llm(sharp, engine)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    assert got == _hf_rows(sharp, prompts, params)
    plain = [
        c.token_ids
        for c in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    ]
    assert got[1::2] == plain[1::2] and got[::2] != plain[::2]  # the penalty changed rows
    if engine is PREEMPTED:  # preempted rows recomputed, their counts made again
        assert llm.engine.scheduler.num_preemptions > 0


def test_penalties_hold_for_n_samples_and_cached_prefixes(sharp):
    """Two greedy samples of a row and rows sharing a cached prefix each count their own
    tokens: each equals transformers' row alone."""
    (prefix,) = random_prompts([13], seed=7)
    prompts = [prefix + p for p in random_prompts([3, 6, 2], seed=1)]
    llm = _llm(sharp, EngineConfig(block_size=4))
    out = llm.generate(
        prompts, SamplingParams(temperature=0, n=2, max_tokens=MAX_NEW, repetition_penalty=1.5)
    )
    want = _hf_rows(sharp, prompts, _mixed(repetition_penalty=1.5)[:1] * len(prompts))
    assert [[c.token_ids for c in r.outputs] for r in out] == [[w, w] for w in want]
    assert any(
        r.outputs[0].completion.cached_tokens for r in out[1:]
    )  # the prefix came from the cache


def _reference_ok(model_dir, prompt, output, presence, frequency) -> bool:
    """Each output token is the argmax of transformers' logits at its position less
    presence x (count > 0) and frequency x count over the output before it (pure Python)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 :].tolist()
    for i, tok in enumerate(output):
        counts = Counter(output[:i])
        row = [
            x - presence * (counts[t] > 0) - frequency * counts[t] for t, x in enumerate(logits[i])
        ]
        if max(range(len(row)), key=row.__getitem__) != tok:
            return False
    return True


@pytest.mark.parametrize("presence, frequency", [(2.0, 0.0), (0.0, 2.0), (1.0, -0.5)])
def test_presence_and_frequency_equal_a_python_reference(sharp, presence, frequency):
    prompts = random_prompts(LENS)
    params = _mixed(presence_penalty=presence, frequency_penalty=frequency)
    llm = _llm(sharp)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    plain = [
        c.token_ids
        for c in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    ]
    assert got[1::2] == plain[1::2] and got[::2] != plain[::2]
    for p, out in zip(prompts[::2], got[::2], strict=True):
        assert _reference_ok(sharp, p, out, presence, frequency)
    # a reference that tells: the unpenalized one refuses some penalized row
    assert not all(_reference_ok(sharp, p, o, 0.0, 0.0) for p, o in zip(prompts, got, strict=True))


def test_logit_bias_bans_and_forces_tokens(sharp):
    prompts = random_prompts(LENS)
    llm = _llm(sharp)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    first = plain[0].token_ids[0]
    banned = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logit_bias={first: -100})
    )
    assert all(first not in c.token_ids for c in banned)
    assert banned[0].token_ids[0] != first
    forced = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0, max_tokens=5, logit_bias={"7": 100}),
            SamplingParams(temperature=0, max_tokens=5),
        ]
        * 3,
    )
    assert all(c.token_ids == [7] * 5 for c in forced[::2])
    assert [c.token_ids for c in forced[1::2]] == [c.token_ids[:5] for c in plain[1::2]]
    # sampled rows too: +100 leaves nothing else to draw
    hot = SamplingParams(max_tokens=4, temperature=1.0, seed=3, logit_bias={9: 200.0})
    assert all(c.token_ids == [9] * 4 for c in llm.generate(prompts, hot))
    bad = llm.generate(prompts[:1], SamplingParams(max_tokens=4, logit_bias={10**6: 1}))
    assert "not in the model's vocabulary" in bad[0].error and "logit_bias" in bad[0].error


def test_sampling_params_take_vllm_names():
    p = SamplingParams(
        temperature=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-1
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, -1)
    assert p.penalized and not SamplingParams(temperature=0).penalized
    assert SamplingParams(temperature=0, logit_bias={"5": 300, 2: -1.5}).logit_bias == (
        (2, -1.5),
        (5, 100.0),
    )
    assert p.sample(1).repetition_penalty == 1.2  # each of n samples keeps them
    for bad in (
        {"repetition_penalty": 0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {3: "a"}},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert logit_bias_pairs('{"4": 1}') == ((4, 1.0),) == logit_bias_pairs([(4, 1)])


@pytest.mark.slow
def test_compiled_sampling_with_penalties_equals_eager(sharp):
    """Penalized greedy and sampled rows next to plain ones, through the compiled decode: the
    same tokens as eager, and no graph beyond the warm-up's (penalties run before the sampling
    graph, whose inputs they do not change)."""
    prompts = random_prompts(LENS)
    params = [
        SamplingParams(
            temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.5, logit_bias={7: -100}
        ),
        SamplingParams(temperature=0, max_tokens=MAX_NEW),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=1, presence_penalty=1.0),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=2),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, logit_bias={9: 100}),
    ]
    engine = EngineConfig(block_size=16)
    want = [c.token_ids for c in _llm(sharp, engine).generate(prompts, params)]
    llm = _llm(sharp, engine, compile=True)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    assert got == want and got[5] == [9] * MAX_NEW  # the penalties applied, both ways
    decode = llm.runner.graph
    assert decode.graphs <= 1 and decode.sample_graphs <= 3 and not decode.failed
    assert llm.runner.shapes  # the steps ran compiled


def _tokens(out) -> list[list[int]]:
    return read_output(out).sort_by("id").column("token_ids").to_pylist()


def test_cli_flags_per_row_columns_and_fingerprint(model, tmp_path):
    data = write_parquet(
        tmp_path / "in.parquet",
        {
            "prompt": ["the quick brown fox", "the lazy dog", "a static cache"],
            "logit_bias": [None, '{"7": 100}', None],  # the row's own, over --logit-bias
            "frequency_penalty": [None, None, 0.0],
        },
    )
    flags = ("--max-new-tokens", "8", "--with-token-ids", "--ignore-eos")
    run_job(data, tmp_path / "plain", model, *flags)
    plain = _tokens(tmp_path / "plain")
    assert "repetition_penalty" not in read_job(tmp_path / "plain")  # an old job's fingerprint
    banned = plain[0][0]
    pen = (
        *("--repetition-penalty", "1.3", "--presence-penalty", "0.5"),
        *("--frequency-penalty", "2", "--logit-bias", json.dumps({str(banned): -100})),
    )
    run_job(data, tmp_path / "pen", model, *flags, *pen)
    got = _tokens(tmp_path / "pen")
    assert banned not in got[0] and got[0] != plain[0]
    assert got[1] == [7] * 8  # the column's bias replaced the job's
    job = read_job(tmp_path / "pen")
    assert job["repetition_penalty"] == 1.3 and job["logit_bias"] == {str(banned): -100.0}
    run_job(data, tmp_path / "pen", model, *flags, *pen)  # the same job: resumed, not refused


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--repetition-penalty", "0", ["repetition-penalty"]),
        ("--presence-penalty", "2.5", ["presence-penalty"]),
        ("--frequency-penalty", "-3", ["frequency-penalty"]),
        ("--logit-bias", "{42: 1}", ["logit_bias", "not JSON"]),
        ("--logit-bias", '{"a": 1}', ["logit_bias", "token id"]),
        ("--logit-bias", '{"100000": 1}', ["logit_bias", "vocabulary", "100000"]),
    ],
)
def test_bad_values_exit_2_with_one_line(model, tmp_path, flag, value, words):
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["hello"]})
    r = run_job(data, tmp_path / "out", model, flag, value, exit_code=2)
    assert_one_line_error(r, *words)


def test_openai_batch_bodies_carry_penalties_per_row(model, tmp_path):
    def line(i: int, **body) -> dict:
        body = {"prompt": "the quick brown fox", "max_tokens": 12, **body}
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}

    data = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            line(0),
            line(1, logit_bias={"7": 100}),
            line(2, presence_penalty=1.0, frequency_penalty=2.0),
            line(3, presence_penalty=5.0),  # out of [-2, 2]: an error row, the job goes on
        ],
    )
    run_job(data, tmp_path / "out", model, "--with-token-ids", "--ignore-eos")
    rows = {r["custom_id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows["r1"]["token_ids"] == [7] * 12 and rows["r0"]["token_ids"] != [7] * 12
    assert rows["r2"]["error"] is None and rows["r2"]["token_ids"] != rows["r0"]["token_ids"]
    assert "presence_penalty" in rows["r3"]["error"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_seen_tokens_table_equals_the_dense_formula(device):
    """apply_penalties against the formula over every logit, step by step, while rows
    grow past the table's width, finish and give their slots to new rows (whose first token
    pads their row: a stale token left there would be penalized). On CUDA too
    (scripts/gpu_check.sh): its gathers and scatters run on the device."""
    from batchgen.engine.penalties import TokenCounts, apply_penalties
    from batchgen.engine.sequence import Request, Scheduled, SeqState, SeqStatus

    g = torch.Generator().manual_seed(0)
    vocab, counts = 50, TokenCounts(50, torch.device(device))
    params = SamplingParams(
        temperature=0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3
    )

    def seq(i: int, n: int) -> SeqState:
        prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
        s = SeqState(Request(i, prompt, params), arrival=i, token_ids=list(prompt))
        s.status = SeqStatus.RUNNING
        return s

    running = [seq(i, n) for i, n in enumerate([3, 20, 1, 9])]
    for step in range(40):
        if step == 15:  # two finish; two new rows take their slots
            for s in running[:2]:
                s.status = SeqStatus.FINISHED
            running = running[2:] + [seq(10, 2), seq(11, 30)]
        logits = torch.randn(len(running), vocab, generator=g)
        want = logits.clone()
        for row, s in enumerate(running):
            out = torch.bincount(torch.tensor(s.output_ids, dtype=torch.long), minlength=vocab)
            seen = out > 0
            seen[s.request.prompt_ids] = True
            x = want[row]
            x[seen] = torch.where(x[seen] > 0, x[seen] / 1.5, x[seen] * 1.5)
            x -= 0.3 * out + 0.4 * (out > 0)
        sampled = [Scheduled(s, 0, 1, True) for s in running]
        got = apply_penalties(logits.to(device), sampled, counts).cpu()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for row, s in enumerate(running):  # the next token: often one seen before
            s.token_ids.append(int(torch.randint(0, vocab // 3, (), generator=g)) + row)
    assert counts.seen.shape[1] >= 32  # widened past its first 8 columns
