"""The score task in the engine: log P(candidate | prompt) for each candidate continuation,
equal to transformers' log-likelihoods of the same tokens (float32, 1e-4), for every family,
whatever the scheduler does (chunked prefill splitting a scored tail, preemption, prefix-cache
hits). The prompt is computed once per row: its candidates take its blocks from the cache."""

import pytest
import torch
import transformers
from helpers import (
    assert_one_line_error,
    prompts,
    read_output,
    read_stats,
    rows_by_id,
    run_job,
    write_parquet,
)
from test_engine import MODELS, _llm, _prompts
from test_engine import dirs as dirs  # noqa: F401  (fixtures)
from test_engine import preempted as preempted  # noqa: F401

from batchgen.engine.config import EngineConfig
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import FinishReason

PROMPT_LENS = [9, 3, 17, 1, 12]
# per row: candidates of 1-5 tokens, some sharing their first tokens
CANDIDATES = [
    [[5], [7, 8], [5, 9, 10]],
    [[11, 12, 13, 14, 15], [11]],
    [[20], [21], [22], [23]],
    [[30, 31], [30, 32]],
    [[40, 41, 42]],
]
ENGINES = {
    "default": EngineConfig(block_size=4),
    "chunked": EngineConfig(block_size=4, max_num_batched_tokens=5),
}


def hf_loglik(model_dir, prompts, candidates) -> list[list[float]]:
    """transformers: the sum of the candidate tokens' log-probabilities given the prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, cands in zip(prompts, candidates, strict=True):
            row = []
            for c in cands:
                ids = torch.tensor([p + c])
                lp = hf(ids).logits[0].log_softmax(-1)
                row.append(sum(lp[len(p) - 1 + j, t].item() for j, t in enumerate(c)))
            out.append(row)
    return out


@pytest.fixture(scope="module")
def references(dirs):  # noqa: F811
    return {m: hf_loglik(dirs[m], _prompts(3, PROMPT_LENS), CANDIDATES) for m in MODELS}


@pytest.fixture
def prompt_tokens(monkeypatch) -> list[int]:
    """Prompt tokens each executed step ran."""
    seen = []
    execute = ModelRunner.execute

    def spy(self, plan, bitmask=None):
        seen.append(sum(s.num_tokens for s in plan.prefills))
        return execute(self, plan, bitmask)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    return seen


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", MODELS)
def test_scores_equal_transformers_loglikelihoods(model, engine, dirs, references):  # noqa: F811
    llm = _llm(dirs[model], ENGINES[engine])
    got = llm.candidate_logprobs(_prompts(3, PROMPT_LENS), CANDIDATES)
    for i, (c, ref) in enumerate(zip(got, references[model], strict=True)):
        assert c.index == i and c.error is None and c.finish_reason is FinishReason.STOP
        assert c.token_ids == [] and c.prompt_tokens == PROMPT_LENS[i]
        assert c.scores == pytest.approx(ref, abs=1e-4), f"row {i}"
    sched = llm.engine.scheduler
    assert sched.pool.num_free == sched.pool.num_usable and not sched.pending
    assert llm.engine.completions.scoring_in_flight == 0


def test_the_prompt_is_computed_once_per_row(dirs, prompt_tokens):  # noqa: F811
    llm = _llm(dirs["llama"], EngineConfig(block_size=4))
    (prompt,) = _prompts(5, [40])  # 10 full blocks
    cands = [[5], [6, 7], [8], [9, 10, 11]]
    (c,) = llm.candidate_logprobs([prompt], [cands])
    # the first candidate runs its 41 tokens; each other one only the prompt's last block
    # (from the token that predicts its first) and its own tokens
    assert sum(prompt_tokens) == 41 + (4 + 2) + (4 + 1) + (4 + 3)
    assert c.cached_tokens == 3 * 36
    alone = [llm.candidate_logprobs([prompt], [[x]])[0].scores[0] for x in cands]
    assert c.scores == pytest.approx(alone, abs=1e-5)


def test_scored_and_generated_rows_run_together_and_survive_preemption(dirs, preempted):  # noqa: F811
    from batchgen.engine.sequence import Request, SamplingParams

    # 10 blocks of 4 for decoding rows that grow: the newest sequences are preempted
    tight = EngineConfig(block_size=4, max_num_batched_tokens=6, kv_cache_tokens=40)
    llm = _llm(dirs["qwen3"], tight)
    prompts = _prompts(3, PROMPT_LENS)
    requests = [
        Request(
            i,
            p,
            SamplingParams(max_new_tokens=12),
            candidates=tuple(map(tuple, c)) if i % 2 else (),
        )
        for i, (p, c) in enumerate(zip(prompts, CANDIDATES, strict=True))
    ]
    got = llm._run(requests)
    assert any(seq.request.scoring for seq in preempted)  # a scored candidate, recomputed
    scored = llm.candidate_logprobs([prompts[i] for i in (1, 3)], [CANDIDATES[i] for i in (1, 3)])
    generated = llm.generate([prompts[i] for i in (0, 2, 4)], SamplingParams(max_new_tokens=12))
    for i, alone in zip((1, 3), scored, strict=True):
        assert got[i].scores == pytest.approx(alone.scores, abs=1e-5)
    assert [got[i].token_ids for i in (0, 2, 4)] == [c.token_ids for c in generated]


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return tiny_dirs["llama"]


def _softmax(xs: list[float]) -> list[float]:
    t = torch.tensor(xs, dtype=torch.float64).softmax(0)
    return t.tolist()


def test_score_task_writes_label_probabilities_equal_to_transformers(tmp_path, llama):
    texts = prompts(5)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts, "text": texts})
    labels = ["yes", "no", "maybe so"]
    out = tmp_path / "out"
    run_job(src, out, llama, "--task", "score", "--choice", ",".join(labels))
    table = read_output(out)
    assert {"label", "scores", "text"} <= set(table.column_names)  # text: the input's, passed on
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    # the prompts end in a word: a bare label is scored after a space (row_options.py)
    cands = [tok(" " + x, add_special_tokens=False)["input_ids"] for x in labels]
    ref = hf_loglik(llama, [tok(t)["input_ids"] for t in texts], [cands] * len(texts))
    for r in table.to_pylist():
        probs = dict(r["scores"])
        assert list(probs) == labels and r["error"] is None and r["completion_tokens"] == 0
        assert list(probs.values()) == pytest.approx(_softmax(ref[r["id"]]), abs=1e-4)
        assert r["label"] == max(probs, key=probs.get) and r["text"] == texts[r["id"]]
    stats = read_stats(out)
    assert stats["rows"] == 5 and stats["rows_error"] == 0


def test_per_row_labels_and_rows_without_any(tmp_path, llama):
    src = write_parquet(
        tmp_path / "in.parquet",
        {"prompt": prompts(3), "choice": [["up", "down"], None, ["left", "right", "on"]]},
    )
    out = tmp_path / "out"
    run_job(src, out, llama, "--task", "score")
    got = rows_by_id(out)
    assert [k for k, _ in got[0]["scores"]] == ["up", "down"]
    assert [k for k, _ in got[2]["scores"]] == ["left", "right", "on"]
    assert got[1]["scores"] is None and "no labels to score" in got[1]["error"]
    assert sum(p for _, p in got[2]["scores"]) == pytest.approx(1.0)
    # the job's --choice fills in for the row without its own; a rerun adds it exactly once
    run_job(src, out, llama, "--task", "score", "--overwrite", "--choice", "a,b")
    got = rows_by_id(out)
    assert [k for k, _ in got[1]["scores"]] == ["a", "b"] and len(got) == 3


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ((), ("--choice", "choice column")),
        (("--choice", "a,b", "--regex", "x+"), ("choice", "regex")),
        (("--choice", "a,b", "--n", 2), ("--n",)),
    ],
)
def test_score_jobs_that_cannot_run_fail_before_the_model_loads(tmp_path, llama, flags, words):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_job(src, tmp_path / "out", llama, "--task", "score", *flags, exit_code=2)
    assert_one_line_error(r, *words)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
