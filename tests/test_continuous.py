"""Continuous batching: rows refilled into the slots of finished ones give exactly what the
static schedule and transformers give, for every row; each request comes back once; the
compiled decode shape never recompiles in steady state (slow)."""

import pytest
import torch
import torch._dynamo
from helpers import FAST, prompts, read_stats, rows_by_id, run_cli, write_parquet
from test_compile import CompileEvents, _snapshot
from test_exactness import hf_greedy
from tiny_models import FAMILIES
from torch._dynamo.utils import counters

from batchgen.engine.scheduler import RoundReport
from batchgen.engine.sequence import FinishReason, Request, SamplingParams
from batchgen.engine.slot_runner import SlotRunner
from batchgen.llm import LLM
from batchgen.planner import BucketConfig

# 4 slots for 12 prompts of 1-30 tokens (buckets 4..32) and 1-30 new tokens: rows finish
# at different rounds, and refills come in several length buckets and counts.
BUCKETS = BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=4)
LENS = [3, 11, 6, 17, 1, 25, 9, 2, 30, 14, 5, 21]
MAX_NEW = [5, 20, 3, 12, 1, 30, 8, 17, 2, 9, 26, 14]


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in LENS]


def _llm(model_dir, schedule: str, compile: bool = False, buckets=BUCKETS) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", compile=compile, buckets=buckets,
               schedule=schedule)  # fmt: skip


@pytest.fixture
def refills(monkeypatch) -> list[tuple[tuple[int, ...], int]]:
    """Records each refill's (slots, prompt bucket)."""
    seen = []
    original = SlotRunner.refill

    def spy(self, refill, requests):
        seen.append((refill.slots, refill.prompt_len))
        return original(self, refill, requests)

    monkeypatch.setattr(SlotRunner, "refill", spy)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_static_and_transformers(family, tiny_dirs, refills):
    prompts_ = _prompts()
    params = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    ref = hf_greedy(tiny_dirs[family], prompts_, max(MAX_NEW))
    static = _llm(tiny_dirs[family], "static").generate(prompts_, params)
    got = _llm(tiny_dirs[family], "continuous").generate(prompts_, params)
    for i, m in enumerate(MAX_NEW):
        assert got[i].token_ids == ref[i][:m], f"row {i}"
        assert got[i].token_ids == static[i].token_ids
        assert got[i].finish_reason == static[i].finish_reason
        assert got[i].text == static[i].text
        assert got[i].logprobs == pytest.approx(static[i].logprobs, abs=1e-4)
    # the slots really were refilled, with other rows still decoding
    assert len(refills) >= 4
    assert refills[0] == ((0, 1, 2, 3), 32)  # 30, 25, 21, 17 tokens: one bucket
    assert {bucket for _, bucket in refills} >= {32, 16, 8, 4}


def _mixed_params(seed_base: int, ignore_eos_even: bool = False) -> list[SamplingParams]:
    """One row in three greedy, the rest sampled with top-k/top-p, each with its own seed."""
    return [
        SamplingParams(
            max_new_tokens=m,
            temperature=0.0 if i % 3 == 2 else 0.9,
            top_k=40,
            top_p=0.95,
            seed=seed_base + i,
            ignore_eos=ignore_eos_even and i % 2 == 0,
        )
        for i, m in enumerate(MAX_NEW)
    ]


def test_seeded_sampling_is_unchanged_by_the_schedule(tiny_dirs, refills):
    prompts_ = _prompts(1)
    params = _mixed_params(seed_base=1000, ignore_eos_even=True)
    static = _llm(tiny_dirs["llama"], "static").generate(prompts_, params)
    got = _llm(tiny_dirs["llama"], "continuous").generate(prompts_, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in static]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in static]
    assert len(refills) >= 4


def test_stop_strings_and_eos_as_in_static(tiny_dirs):
    static_llm = _llm(tiny_dirs["llama"], "static")
    prompts_ = _prompts(2)
    free = static_llm.generate(prompts_, SamplingParams(max_new_tokens=30, ignore_eos=True))
    # each even row stops at the text of its 6th token (found again later or not)
    params = []
    for i, c in enumerate(free):
        stop = (static_llm.decode(c.token_ids[5:6]),) if i % 2 == 0 else ()
        params.append(SamplingParams(max_new_tokens=MAX_NEW[i] + 10, stop=stop))
    static = static_llm.generate(prompts_, params)
    got = _llm(tiny_dirs["llama"], "continuous").generate(prompts_, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in static]
    assert [c.text for c in got] == [c.text for c in static]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in static]
    assert sum(c.finish_reason == FinishReason.STOP for c in got) >= 3


def test_each_request_is_yielded_once_as_rows_finish(tiny_dirs):
    llm = _llm(tiny_dirs["llama"], "continuous")
    reqs = [
        Request(i, p, SamplingParams(max_new_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(zip(_prompts(), MAX_NEW, strict=True))
    ]
    indices, rounds, computed = [], 0, 0
    for report, completions in llm.engine.generate(reqs):
        assert isinstance(report, RoundReport) and completions
        rounds += 1
        computed += report.computed_prompt_tokens
        indices += [c.index for c in completions]
        for c in completions:
            assert len(c.token_ids) == MAX_NEW[c.index]
    assert sorted(indices) == list(range(len(reqs)))
    assert rounds > 2  # rows came back as they finished, not all at the end
    assert computed >= sum(LENS)
    # the first four (longest prompts: rows 8, 5, 11, 3) start together; row 8 makes 2
    # tokens and comes back first, row 5 makes 30 and comes back after refilled rows
    assert indices[0] == 8
    assert indices.index(5) > indices.index(9)  # row 9: refilled into 8's slot, 9 tokens


def test_more_slots_than_requests_and_a_one_token_row(tiny_dirs):
    llm = _llm(tiny_dirs["gpt2"], "continuous", buckets=BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=8))  # fmt: skip
    static = _llm(tiny_dirs["gpt2"], "static")
    prompts_, params = _prompts()[:3], [SamplingParams(max_new_tokens=m) for m in (1, 17, 4)]
    got = llm.generate(prompts_, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in static.generate(prompts_, params)]
    assert llm.generate([], SamplingParams()) == []


def test_cli_schedule_continuous_equals_static(tmp_path, tiny_dirs):
    model = tiny_dirs["llama"]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(12)})
    outs = {}
    for schedule in ("static", "continuous"):
        out = tmp_path / schedule
        run_cli("run", src, "-o", out, "--model", model, *FAST, "--max-new-tokens", 10,
                "--max-batch", 4, "--with-token-ids", "--schedule", schedule)  # fmt: skip
        outs[schedule] = rows_by_id(out)
        stats = read_stats(out)
        assert stats["schedule"] == schedule and stats["rows"] == 12
        assert stats["computed_prompt_tokens"] >= stats["prompt_tokens"] > 0
    assert outs["continuous"] == outs["static"]


# --- shared prefix ------------------------------------------------------------------------

PREFIX_BUCKETS = BucketConfig(max_prompt_len=128, min_bucket=4, max_batch=4)


def _prefixed(prefix_len: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, 500, (prefix_len,), generator=g).tolist()
    return [prefix + p for p in _prompts(seed)]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reuse_equals_no_reuse_and_transformers(family, tiny_dirs, refills):
    prompts_ = _prefixed(37)  # shared: 37 tokens, reused: 32
    params = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    ref = hf_greedy(tiny_dirs[family], prompts_, max(MAX_NEW))
    static = _llm(tiny_dirs[family], "static", buckets=PREFIX_BUCKETS).generate(prompts_, params)
    llm = LLM(tiny_dirs[family], dtype="float32", device="cpu", compile=False,
              buckets=PREFIX_BUCKETS, schedule="continuous", prefix_reuse=True)  # fmt: skip
    got = llm.generate(prompts_, params)
    for i, m in enumerate(MAX_NEW):
        assert got[i].token_ids == ref[i][:m], f"row {i}"
        assert got[i].token_ids == static[i].token_ids
        assert got[i].finish_reason == static[i].finish_reason
        assert got[i].logprobs == pytest.approx(static[i].logprobs, abs=1e-4)
    assert llm.runner.stats.prefix_tokens_saved == 32 * (len(prompts_) - 1)
    assert len(refills) >= 4


def test_prefix_reuse_keeps_seeded_sampling_and_skips_short_prefixes(tiny_dirs):
    params = _mixed_params(seed_base=2000)
    static = _llm(tiny_dirs["qwen3"], "static", buckets=PREFIX_BUCKETS)
    reuse = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", compile=False,
                buckets=PREFIX_BUCKETS, schedule="continuous", prefix_reuse=True)  # fmt: skip
    prompts_ = _prefixed(50)
    got = reuse.generate(prompts_, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in static.generate(prompts_, params)]
    assert reuse.runner.stats.prefix_tokens_saved == 48 * (len(prompts_) - 1)
    # a 10-token common prefix is under the minimum: nothing reused, same outputs
    short = _prefixed(10)
    got = reuse.generate(short, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in static.generate(short, params)]
    assert reuse.runner.stats.prefix_tokens_saved == 48 * (len(prompts_) - 1)


def test_cli_prefix_reuse_reports_tokens_saved(tmp_path, tiny_dirs):
    model = tiny_dirs["llama"]
    texts = ["label the sentiment of this review: great product, would buy again. " + t
             for t in prompts(8)]  # fmt: skip
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts})
    outs = {}
    for name, flags in {"static": (), "reuse": ("--schedule", "continuous", "--prefix-reuse")}.items():  # fmt: skip
        out = tmp_path / name
        run_cli("run", src, "-o", out, "--model", model, *FAST, "--max-new-tokens", 6,
                "--max-batch", 4, "--with-token-ids", *flags)  # fmt: skip
        outs[name] = rows_by_id(out)
        saved = read_stats(out)["prefix_tokens_saved"]
        assert (saved > 0) == (name == "reuse")
    assert outs["reuse"] == outs["static"]
    run_cli("run", src, "-o", tmp_path / "bad", "--model", model, *FAST, "--prefix-reuse",
            exit_code=2)  # fmt: skip


# One prompt bucket (32), 8 slots, new-token bucket 16: one decode graph, stride 48.
COMPILED = BucketConfig(max_prompt_len=32, min_bucket=32, max_batch=8)


def _window(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """12 rows of 1-32 tokens, 1-16 new tokens, greedy and seeded sampled rows mixed."""
    g = torch.Generator().manual_seed(seed)
    prompts_, params = [], []
    for i in range(12):
        length = int(torch.randint(1, 33, (1,), generator=g))
        prompts_.append(torch.randint(2, 500, (length,), generator=g).tolist())
        max_new = 16 if i == 0 else int(torch.randint(1, 17, (1,), generator=g))
        params.append(SamplingParams(max_new_tokens=max_new, temperature=0.0 if i % 3 == 2 else 0.9,
                                     top_k=40, top_p=0.95, seed=seed * 100 + i))  # fmt: skip
    return prompts_, params


@pytest.mark.slow
def test_compiled_no_recompilation_in_steady_state(tiny_dirs):
    path = tiny_dirs["llama"]
    llm = _llm(path, "continuous", compile=True, buckets=COMPILED)
    eager = _llm(path, "static", buckets=COMPILED)

    before = _snapshot()
    prompts_, params = _window(0)
    first = llm.generate(prompts_, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in eager.generate(prompts_, params)]
    # one decode graph, (8 slots, 48), plus one prefill graph per refill shape used
    shapes = set(llm.runner.stats.shapes)
    assert {s for s in shapes if s[0] == "decode"} == {("decode", 8, 48, 48, False)}
    # at most one graph per shape (fewer when an earlier test in this process compiled
    # the same prefill code and shape, which dynamo then reuses)
    assert 1 <= _snapshot()["unique_graphs"] - before["unique_graphs"] <= len(shapes)

    steady = _snapshot()
    graphs = counters["stats"]["unique_graphs"]
    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2, 3):
            prompts_, params = _window(seed)
            got = llm.generate(prompts_, params)
            want = eager.generate(prompts_, params)
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert events.n == 0
    assert counters["stats"]["unique_graphs"] == graphs
    assert _snapshot() == steady
    assert llm.runner.stats.shapes == shapes  # later windows reuse the warm-up's shapes
