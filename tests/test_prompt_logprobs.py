"""Prompt log-probabilities: each prompt token's log-probability given the tokens before it
(and its position's top alternatives), equal to transformers' log_softmax of a full forward's
logits (float32, 1e-4) on the sharpened models, for mixed lengths, chunked prompts, prompts
whose prefixes are in the prefix cache and rows preempted and recomputed; through the Python
API (`SamplingParams(prompt_logprobs=k)`, vLLM's shape) and `batchgen run --task
prompt-logprobs`; and computed chunk by chunk, so a long prompt's peak memory does not grow
with its length."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    FAST,
    assert_one_line_error,
    cpu_llm,
    random_prompts,
    rows_by_id,
    run_cli,
    run_job,
    write_parquet,
)
from test_engine import MODELS
from test_engine import dirs as dirs  # noqa: F401  (fixtures)
from test_engine import preempted as preempted  # noqa: F401

from batchgen.api.sampling import SamplingParams
from batchgen.engine import scored_logprobs
from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import Request
from batchgen.engine.sequence import SamplingParams as EngineParams
from batchgen.llm import LLM

LENS = [9, 3, 17, 1, 12, 25]
TOP = 3
ENGINES = {
    "default": EngineConfig(block_size=4),
    "chunked": EngineConfig(block_size=4, max_num_batched_tokens=5),
}


def hf_logprobs(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers: each prompt's (len - 1, vocab) log_softmax, position j predicting j + 1."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0, :-1].log_softmax(-1) for p in prompts]


def assert_equal_reference(prompt, got_lps, got_top, ref: torch.Tensor, k: int) -> None:
    """One prompt's logprobs (the first None) and top-k lists against transformers'."""
    assert len(got_lps) == len(prompt) and got_lps[0] is None
    want = ref.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got_lps[1:], dtype=torch.float32), want, atol=1e-4)
    if not k:
        assert got_top is None
        return
    assert len(got_top) == len(prompt) and got_top[0] == []
    values, ids = ref.topk(k, -1)
    for j, top in enumerate(got_top[1:]):
        assert [t for t, _ in top] == ids[j].tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values[j], atol=1e-4)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Mixed lengths; the last three share a 13-token prefix (three blocks of 4 and one)."""
    plain = random_prompts(LENS, seed=3)
    (prefix,) = random_prompts([13], seed=4)
    return plain + [prefix + p for p in random_prompts([2, 7, 5], seed=5)]


@pytest.fixture(scope="module")
def references(dirs, prompts):  # noqa: F811
    return {m: hf_logprobs(dirs[m], prompts) for m in MODELS}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", MODELS)
def test_prompt_logprobs_equal_transformers(model, engine, dirs, prompts, references):  # noqa: F811
    """The prompt-logprobs task's requests (scored from token 1, nothing sampled), after the
    same prompts ran generating: their blocks are in the prefix cache, and the scored rows
    must compute every position anyway."""
    llm = cpu_llm(dirs[model], engine=ENGINES[engine])
    llm.generate(prompts, SamplingParams(max_tokens=2))
    assert llm.engine.scheduler.pool.hits > 0  # the shared prefix was a hit there
    params = EngineParams(prompt_logprobs=TOP)
    reqs = [Request(i, p, params, score_from=1) for i, p in enumerate(prompts)]
    got = llm._run(reqs)
    for p, c, ref in zip(prompts, got, references[model], strict=True):
        assert c.token_ids == [] and c.cached_tokens == 0
        assert_equal_reference(p, c.prompt_logprobs, c.prompt_top_logprobs, ref, TOP)


def test_the_lm_head_scores_a_step_a_slice_at_a_time(
    monkeypatch,
    dirs,  # noqa: F811
    prompts,
    references,
):
    """Every prompt in one step, and the LM head still runs on at most SLICE_ROWS scored rows
    a call (their logits never the whole step's at once), the results transformers'."""
    monkeypatch.setattr(scored_logprobs, "SLICE_ROWS", 4)
    llm = cpu_llm(dirs["llama"], engine=EngineConfig(block_size=4))
    reqs = [
        Request(i, p, EngineParams(prompt_logprobs=1), score_from=1) for i, p in enumerate(prompts)
    ]
    llm._run(reqs[:1])  # the warm-up's steps run at the first call
    rows: list[int] = []
    head = llm.engine.runner.model.lm_head
    hook = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    got = llm._run(reqs)
    hook.remove()
    assert max(rows) == 4 and sum(rows) == sum(len(p) - 1 for p in prompts)
    for p, c, ref in zip(prompts, got, references["llama"], strict=True):
        assert_equal_reference(p, c.prompt_logprobs, c.prompt_top_logprobs, ref, 1)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_prompt_logprobs_on_the_transformers_backend(model_type, hf_dirs, prompts):
    """`model_impl="transformers"`: the scored rows reach transformers' own LM head
    (`logits_to_keep`), Gemma 2's final soft-cap included."""
    d = hf_dirs(model_type)
    llm = cpu_llm(d, engine=ENGINES["chunked"], model_impl="transformers")
    reqs = [
        Request(i, p, EngineParams(prompt_logprobs=TOP), score_from=1)
        for i, p in enumerate(prompts)
    ]
    for p, c, ref in zip(prompts, llm._run(reqs), hf_logprobs(d, prompts), strict=True):
        assert_equal_reference(p, c.prompt_logprobs, c.prompt_top_logprobs, ref, TOP)


def test_prompt_logprobs_at_two_tensor_parallel_ranks(model, prompts):
    """Two ranks over gloo (this process rank 0): rank 0 scores from the reduced logits."""
    engine = EngineConfig(block_size=4, max_num_batched_tokens=8, kv_cache_tokens=1024)
    with LLM(model, device="cpu", engine=engine, tensor_parallel_size=2) as llm:
        out = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    for p, o, ref in zip(prompts, out, hf_logprobs(model, prompts), strict=True):
        c = o.outputs[0].completion  # the engine's record under vLLM's CompletionOutput
        assert_equal_reference(p, c.prompt_logprobs, c.prompt_top_logprobs, ref, 1)


def test_generate_with_prompt_logprobs_keeps_its_tokens_under_preemption(
    dirs,  # noqa: F811
    prompts,
    references,
    preempted,  # noqa: F811
):
    """SamplingParams(prompt_logprobs=k) on generating rows: the tokens are those generated
    without it, RequestOutput.prompt_logprobs is vLLM's shape with transformers' values, and
    rows preempted and recomputed score their prompt once."""
    engine = EngineConfig(block_size=4, kv_cache_tokens=64, max_num_batched_tokens=16)
    llm = cpu_llm(dirs["llama"], engine=engine)
    plain = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2))
    assert preempted, "the pool was meant to preempt rows"
    for p, o, base, ref in zip(prompts, outs, plain, references["llama"], strict=True):
        assert o.outputs[0].token_ids == base.outputs[0].token_ids
        c = o.outputs[0].completion
        assert_equal_reference(p, c.prompt_logprobs, c.prompt_top_logprobs, ref, 2)
        vllm = o.prompt_logprobs
        assert vllm[0] is None and len(vllm) == len(p)
        for j, d in enumerate(vllm[1:]):
            assert d[p[j + 1]].logprob == pytest.approx(ref[j, p[j + 1]].item(), abs=1e-4)
            best = ref[j].topk(2).indices.tolist()
            assert [t for t, lp in d.items() if lp.rank is not None] == best
    assert base_params_untouched(plain)


def base_params_untouched(outs) -> bool:
    """Rows generated without prompt_logprobs carry none."""
    return all(
        o.prompt_logprobs is None and o.outputs[0].completion.prompt_logprobs is None for o in outs
    )


def test_cli_prompt_logprobs_columns(tmp_path, dirs):  # noqa: F811
    """`batchgen run --task prompt-logprobs`: the columns equal transformers' over the tokenized
    prompt; prompt_nll and perplexity follow from them; a bad row is an error record and the
    job goes on; a rerun after a partial one writes every row exactly once."""
    model = dirs["llama"]
    texts = ["the quick brown fox", "a static cache keeps every shape fixed", None, "so"]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts, "k": list(range(4))})
    out = tmp_path / "out"
    flags = ("--task", "prompt-logprobs", "--prompt-logprobs", "2", "--max-num-batched-tokens")
    run_job(src, out, model, *flags, "4", "--limit", "2")  # a partial run, then the rest
    run_job(src, out, model, *flags, "4")
    rows = rows_by_id(out)
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[2]["error"] and rows[2]["prompt_logprobs"] is None
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids = [tok(t)["input_ids"] for t in texts if t is not None]
    refs = hf_logprobs(model, ids)
    for i, p, ref in zip((0, 1, 3), ids, refs, strict=True):
        r = rows[i]
        assert r["prompt_tokens"] == len(p) and r["completion_tokens"] == 0 and r["k"] == i
        assert "generated_text" not in r and r["finish_reason"] == "stop"
        tops = [[(d["id"], d["logprob"]) for d in t] for t in r["prompt_top_logprobs"]]
        assert_equal_reference(p, r["prompt_logprobs"], tops, ref, 2)
        nll = -sum(r["prompt_logprobs"][1:])
        assert r["prompt_nll"] == pytest.approx(nll, rel=1e-6)
        want_ppl = math.exp(nll / (len(p) - 1)) if len(p) > 1 else None
        assert r["perplexity"] == (want_ppl and pytest.approx(want_ppl, rel=1e-6))


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--prompt-logprobs", "2"), ["--task prompt-logprobs"]),
        (("--task", "prompt-logprobs", "--n", "2"), ["samples nothing", "--n"]),
        (("--task", "prompt-logprobs", "--choice", "a,b"), ["--choice"]),
        (("--task", "prompt-logprobs", "--prompt-logprobs", "21"), ["prompt_logprobs", "20"]),
    ],
)
def test_cli_prompt_logprobs_refuses_options_that_mean_nothing(tmp_path, model, flags, words):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["a b"]})
    r = run_job(src, tmp_path / "out", model, *flags, exit_code=2)
    assert_one_line_error(r, *words)
    assert not (tmp_path / "out").exists()


PEAK_SOURCE = """
import sys, torch
from batchgen.engine import scored_logprobs
from batchgen.engine.config import EngineConfig
from batchgen.llm import LLM
from batchgen.api.sampling import SamplingParams

model, n, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, dtype="float32", device="cpu", compile=False,
          engine=EngineConfig(max_num_batched_tokens=budget, kv_cache_tokens=n + 256))
prompt = torch.randint(2, 32000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
llm.generate([prompt[:300]], SamplingParams(max_tokens=1, prompt_logprobs=1))  # warm

def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set back to the current one
before = hwm()
out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
assert len(out[0].prompt_logprobs) == n
print((hwm() - before) // 1024)
"""


def peak_mib(model: Path, n: int, budget: int = 256) -> int:
    """MiB the peak resident set grows by over prompt logprobs of an n-token prompt, run in a
    fresh process at `budget` tokens a step (also what docs/benchmarks.md's figure ran)."""
    r = subprocess.run(
        [sys.executable, "-c", PEAK_SOURCE, str(model), str(n), str(budget)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(r.stdout.strip().splitlines()[-1])


def test_long_prompt_logprobs_peak_memory_does_not_grow_with_its_length(wide_vocab_model):
    """Prompt logprobs of 2k- and 8k-token prompts on a 32k vocabulary, 256 tokens a step:
    the whole prompt's float32 logits would be 250 MiB and 1000 MiB; the peak resident set
    over the call grows by what one step's logits take (256 x 32k x 4 bytes = 32 MiB, a few
    copies of it) plus the host lists, the same for both lengths."""
    short, long = peak_mib(wide_vocab_model, 2048), peak_mib(wide_vocab_model, 8192)
    assert long < 160, (short, long)  # the 8k prompt's logits alone: 1000 MiB
    assert long - short < 48, (short, long)


def test_long_prompt_logprobs_peak_memory_does_not_grow_with_the_step_budget(wide_vocab_model):
    """The 8k-token prompt in one step (8,192 tokens a step): the LM head still runs on
    SLICE_ROWS rows at a time, so the peak stays far below the step's full logits (1000 MiB;
    it grew by ~1,070 MiB when the head ran on the whole step at once)."""
    assert peak_mib(wide_vocab_model, 8192, budget=8192) < 200


def test_job_spec_plan_and_report_of_a_prompt_logprobs_job(tmp_path, model):
    """`task: prompt-logprobs` in a job spec; `batchgen plan` counts no output tokens and the
    prompt alone as a row's length; `batchgen report` draws the finished job's page."""
    texts = ["the quick brown fox", "so the compiler sees one graph"]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts})
    out = tmp_path / "out"
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"input: {src}\noutput: {out}\nmodel: {model}\ntask: prompt-logprobs\nprompt_logprobs: 1\n"
    )
    plan = json.loads(run_cli("plan", spec, "--json").stdout)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    lens = [len(tok(t)["input_ids"]) for t in texts]
    assert plan["max_output_tokens"] == 0 and plan["longest_row_tokens"] == max(lens)
    run_cli("run", spec, *FAST)
    rows = rows_by_id(out)
    assert [len(rows[i]["prompt_top_logprobs"][1]) for i in (0, 1)] == [1, 1]
    assert [rows[i]["prompt_tokens"] for i in (0, 1)] == lens
    run_cli("report", out)
    assert (out / ".batchgen" / "report.html").stat().st_size > 0
