"""Pooled rows (task embed / classify) through the compiled forward: the one graph of
`Transformer.hidden` over a symbolic token count (engine/compiled_forward.py) gives the final
hidden states, pooled eagerly after it (engine/pooling.py). Embeddings equal eager's (cosine >=
0.99999, float32), classifier probabilities within 1e-5, and no compile after the warm-up
(dynamo's compile events under error_on_recompile, as test_compile.py counts them)."""

import numpy as np
import pytest
import torch
import torch._dynamo
from helpers import cpu_llm, read_stats, rows_by_id, run_job, write_parquet
from test_classify import save_classifier
from test_compile import CompileEvents

TEXTS = [
    "the quick brown fox",
    "a",
    "hello world and all the people in it " * 6,  # chunked at 16 tokens a step
    "the quick brown fox jumps over the lazy dog",
]


@pytest.fixture(scope="module")
def classifier(sharp_dirs, tmp_path_factory):
    return save_classifier(sharp_dirs["llama"], tmp_path_factory.mktemp("cls") / "c", 3)


def min_cosine(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    return float(((got * want).sum(1) / norms).min())


def pooled(llm, texts: list[str]) -> dict[str, np.ndarray]:
    out = {
        m: [o.outputs.embedding for o in llm.embed(texts, pooling=m)]
        for m in ("mean", "last", "cls")
    }
    out["probs"] = [o.outputs.probs for o in llm.classify(texts)]
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.slow
def test_compiled_embed_and_classify_equal_eager_with_no_recompiles(classifier):
    kw = {"max_num_batched_tokens": 16, "block_size": 4}
    with cpu_llm(classifier, **kw) as llm:
        want = pooled(llm, TEXTS)
    with cpu_llm(classifier, compile=True, **kw) as llm:
        got = pooled(llm, TEXTS)
        graph = llm.runner.graph
        assert graph.graphs == 1 and not graph.failed
        for mode in ("mean", "last", "cls"):
            assert min_cosine(got[mode], want[mode]) >= 0.99999, mode
        assert np.allclose(got["probs"], want["probs"], atol=1e-5)
        more = [t + " and more" * k for k in range(3) for t in TEXTS]  # other token counts
        with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
            again = pooled(llm, more)
        assert events.n == 0 and graph.graphs == 1
    with cpu_llm(classifier, **kw) as llm:
        eager = pooled(llm, more)
    assert min_cosine(again["mean"], eager["mean"]) >= 0.99999


@pytest.mark.slow
def test_cli_task_embed_compiled_runs_every_token_through_the_graph(classifier, tmp_path):
    """`--task embed --compile` and `--task classify --compile`: every prompt token through the
    graph (compiled_token_share 1), no shape compiled after the warm-up, eager's results."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": TEXTS * 3})
    for task, column in (("embed", "embedding"), ("classify", "probs")):
        flags = ("--task", task, "--pooling", "mean") if task == "embed" else ("--task", task)
        flags += ("--max-num-batched-tokens", "16")
        run_job(src, tmp_path / f"{task}-eager", classifier, *flags)
        run_job(src, tmp_path / task, classifier, *flags, "--compile")
        stats = read_stats(tmp_path / task)
        assert stats["compiled"] and stats["compiled_token_share"] == 1.0
        assert stats["compiled_shapes"] == 0  # nothing compiled after the warm-up
        want, got = rows_by_id(tmp_path / f"{task}-eager"), rows_by_id(tmp_path / task)
        want = [want[i][column] for i in range(12)]
        got = [got[i][column] for i in range(12)]
        if task == "embed":
            assert min_cosine(got, want) >= 0.99999
        else:
            assert np.allclose(got, want, atol=1e-5)
