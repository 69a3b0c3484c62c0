"""Compiled decoding at the GPU's defaults, on the CPU: one compile of the model per job,
compiled == eager, no recompiles in steady state, a fallback that keeps the job going, and a
compile cache that a second process loads.

The forward is compiled once over a symbolic batch with attention as an opaque op
(engine/compiled_forward.py, model/attention/op.py), sampling is a small graph of its own,
and a warm-up compiles both before the first row. Compiling costs seconds on the CPU, so the
end-to-end tests are marked slow.
"""

import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch._dynamo
from helpers import cli_command, read_stats, rows_by_id, write_jsonl
from tiny_models import save_tiny_model
from torch._dynamo.callback import callback_handler

from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import ConstraintKind
from batchgen.engine.sequence import Constraint, FinishReason, Request, SamplingParams
from batchgen.engine.step_inputs import capture_sizes, padded_batch, token_sizes
from batchgen.llm import LLM
from batchgen.model.attention.step import DECODE_ATTENTION_ENV
from batchgen.model.families.transformer import Transformer

# The GPU's default block size; 8 sequences, so the job meets every batch size from 1 to 8.
ENGINE = EngineConfig(max_num_seqs=8, block_size=16, kv_cache_tokens=2048)
ROWS = 13


class CompileEvents:
    """Counts dynamo compilation starts while installed."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, args) -> None:
        self.n += 1

    def __enter__(self):
        callback_handler.register_start_callback(self)
        return self

    def __exit__(self, *exc) -> None:
        callback_handler.remove_start_callback(self)


def _workload(seed: int = 0) -> list[Request]:
    """ROWS rows of 1-40 tokens and 1-20 new tokens: greedy, seeded sampled, constrained
    (a choice) and top-logprob rows mixed."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(ROWS):
        n = int(torch.randint(1, 41, (1,), generator=g))
        prompt = torch.randint(2, 500, (n,), generator=g).tolist()
        max_new = int(torch.randint(1, 21, (1,), generator=g))
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=0.8 if i % 3 == 0 else 0.0,
            top_k=40,
            top_p=0.95,
            seed=seed * 100 + i,
            top_logprobs=2 if i % 4 == 1 else 0,
            constraint=Constraint(ConstraintKind.CHOICE, ("alpha", "beta")) if i == 5 else None,
        )
        reqs.append(Request(i, prompt, params))
    return reqs


def _run(llm: LLM, reqs: list[Request]) -> tuple[list, list]:
    reports = list(llm.engine.generate(reqs))
    done = sorted((c for r in reports for c in r.finished), key=lambda c: c.index)
    assert [c.index for c in done] == list(range(len(reqs)))  # each request once
    for c in done:
        assert c.error is None, c.error
        assert (
            len(c.token_ids) == reqs[c.index].params.max_new_tokens
            or c.finish_reason == FinishReason.STOP
        )
    return reports, [(c.token_ids, c.top_logprobs) for c in done]


def _same(got: list, want: list) -> None:
    for (ids, top), (want_ids, want_top) in zip(got, want, strict=True):
        assert ids == want_ids
        if want_top is not None:
            assert [[t for t, _ in step] for step in top] == [[t for t, _ in s] for s in want_top]


# The GPU's defaults (engine/config.py), on the CPU.
GPU_DEFAULTS = EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)


def _many_rows(n: int) -> list[Request]:
    """n rows of 1-40 prompt tokens and 1-12 new tokens, greedy and seeded sampled: with n
    above max_num_seqs, rows are admitted (prefill chunks) while others decode."""
    g = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(n):
        prompt = torch.randint(2, 500, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g)
        params = SamplingParams(
            max_new_tokens=int(torch.randint(1, 13, (1,), generator=g)),
            temperature=0.8 if i % 3 == 0 else 0.0,
            seed=i,
        )
        reqs.append(Request(i, prompt.tolist(), params))
    return reqs


@pytest.mark.slow
@pytest.mark.parametrize("head_dim, path", [(64, "gather"), (128, "flex")])
def test_every_step_runs_compiled_at_the_gpu_defaults(tmp_path, monkeypatch, head_dim, path):
    """Block 16, 256 sequences, 8192 tokens a step, 300 rows: prefill chunks and decodes in
    one step run through the one graph (compiled_token_share 1), the model compiled once at
    warm-up and never after (error_on_recompile, dynamo's compile events), tokens equal
    eager. Flex is the GPU's decode path (its kernel compiled on its own inside the op)."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, path)
    torch._dynamo.reset()  # as a fresh process: no graph of an earlier test's engine to reuse
    model = save_tiny_model("llama", tmp_path / "m", head_dim=head_dim, num_key_value_heads=2)
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=GPU_DEFAULTS)
    _, want = _run(eager, _many_rows(300))
    llm = LLM(model, dtype="float32", device="cpu", compile=True, engine=GPU_DEFAULTS)
    reports, got = _run(llm, _many_rows(300))
    _same(got, want)
    warm, steps = reports[0], [r for r in reports[1:] if r.prompt_tokens or r.decode_rows]
    # inductor built the graphs, or loaded them from its cache (a rerun of this source)
    assert warm.compile_seconds > 0 and warm.graphs_compiled + warm.graphs_loaded >= 1
    assert any(r.prefill and r.decode_rows for r in steps)  # mixed steps happened
    tokens = sum(r.prompt_tokens + r.decode_rows for r in steps)
    compiled = sum(r.prompt_tokens + r.decode_rows for r in steps if r.compiled)
    assert compiled / tokens >= 0.95 and compiled == tokens
    graph = llm.runner.graph
    # the model once; sampling at most three times (greedy, sampled, filtered: none if an
    # earlier engine in the process compiled them, its graphs being a module function's)
    assert graph.graphs == 1 and graph.sample_graphs <= 3
    assert not any(r.new_shape or r.compile_seconds for r in steps)
    assert len(llm.runner.shapes) > 10  # many token counts, one graph

    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        _, again = _run(llm, _many_rows(300))
    assert events.n == 0 and again == got and graph.graphs == 1


def _broken_hidden(self, tokens, positions):
    torch._dynamo.graph_break()  # code dynamo cannot trace into the one graph
    return _real_hidden(self, tokens, positions)


_real_hidden = Transformer.hidden


@pytest.mark.slow
def test_a_failed_symbolic_compile_runs_eagerly_and_the_job_goes_on(model, monkeypatch, caplog):
    """A forward that cannot be one graph (here a graph break): one warning, the steps run
    eagerly (compiled_token_share 0), the tokens are eager's; at 256 sequences, 34 sampling
    capture sizes (the old per-size static fallback died at the 9th)."""
    assert len(capture_sizes(GPU_DEFAULTS.max_num_seqs)) == 34
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=GPU_DEFAULTS)
    _, want = _run(eager, _many_rows(40))
    monkeypatch.setattr(Transformer, "hidden", _broken_hidden)
    llm = LLM(model, dtype="float32", device="cpu", compile=True, engine=GPU_DEFAULTS)
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.compiled_forward"):
        reports, got = _run(llm, _many_rows(40))
    _same(got, want)
    assert llm.runner.graph.failed
    assert caplog.text.count("run eagerly instead") == 1
    assert not any(r.compiled for r in reports)


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(256)[:6] == [2, 4, 8, 16, 24, 32] and capture_sizes(256)[-1] == 256
    assert len(capture_sizes(256)) == 34 and capture_sizes(1) == [2]
    for n in range(1, 257):
        b = padded_batch(n)
        assert b >= n and b in capture_sizes(256) and b in capture_sizes(max(n, 2))


def test_token_sizes_stop_at_the_cap():
    """CUDA graphs at 2, 4, 8, then steps of 8 to 512 tokens (vLLM's list); a budget below
    the cap ends the list at it."""
    assert token_sizes(8192)[:4] == [2, 4, 8, 16] and token_sizes(8192)[-1] == 512
    assert len(token_sizes(8192)) == 66 and token_sizes(100)[-1] == 104


def test_the_cache_key_changes_with_what_changes_the_graphs(model, tmp_path):
    def key(**kw) -> str:
        llm = LLM(model, device="cpu", compile=True, compile_cache=tmp_path, **kw)
        return llm.spec.compile_cache_for(llm.quant, llm.lora).key

    base = key(dtype="float32")
    assert key(dtype="float32") == base
    assert key(dtype="bfloat16") != base
    assert key(dtype="float32", engine=EngineConfig(block_size=32)) != base
    off = LLM(model, device="cpu", compile=True, compile_cache="off")
    assert off.spec.compile_cache_for(off.quant, off.lora) is None


def test_the_cache_key_changes_with_a_lora_adapter(model, lora_dir, tmp_path):
    plain = LLM(model, device="cpu", compile=True, compile_cache=tmp_path)
    adapted = LLM(model, device="cpu", compile=True, compile_cache=tmp_path, lora=lora_dir)
    keys = [m.spec.compile_cache_for(m.quant, m.lora).key for m in (plain, adapted)]
    assert keys[0] != keys[1]


def _compiled_job(
    data: Path, out: Path, model: Path, cache: Path, tmp: Path, kv: int, seqs: int, *more
):
    """A compiled job in a process of its own whose local folders are fresh, as on another
    node: TMPDIR (where the local inductor folder lives, on the CPU as on a GPU) and
    TORCHINDUCTOR_CACHE_DIR."""
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    r = subprocess.run(
        cli_command(
            "run",
            data,
            "-o",
            out,
            "--model",
            model,
            "--compile",
            "--compile-cache",
            cache,
            "--max-new-tokens",
            12,
            "--max-num-seqs",
            seqs,
            "--kv-cache-tokens",
            kv,
            "--quiet",
            *more,
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return read_stats(out)


@pytest.mark.slow
def test_a_second_process_loads_the_compile_cache(model, tmp_path):
    """Cold: a miss, the graphs compiled and saved. Warm, in a new process with fresh local
    folders, another KV pool size and another --max-num-seqs: a hit that compiles no graph
    (torch's own counters: inductor loaded every graph from the artifacts), nothing compiled
    after the warm-up, every token through the graph, the same text. (On the old code the
    artifacts loaded outside the folder the compile read, and the graph held the pool's
    size: every graph compiled again.)"""
    rows = [{"prompt": f"row {i} " + "word " * (i * 3 % 17)} for i in range(24)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cache = tmp_path / "cache"
    cold = _compiled_job(data, tmp_path / "a", model, cache, tmp_path / "tmp-a", 2048, 8)
    warm = _compiled_job(data, tmp_path / "b", model, cache, tmp_path / "tmp-b", 4096, 5)
    assert (cold["compile_cache"], warm["compile_cache"]) == ("miss", "hit")
    assert cold["graphs_compiled"] >= 1 and warm["graphs_compiled"] == 0
    assert len(list(cache.glob("*/artifacts.bin"))) == 1
    assert cold["compiled_shapes"] == warm["compiled_shapes"] == 0  # no compile after warm-up
    assert cold["compiled_token_share"] == warm["compiled_token_share"] == 1.0
    a, b = rows_by_id(tmp_path / "a"), rows_by_id(tmp_path / "b")
    assert {k: r["generated_text"] for k, r in a.items()} == {
        k: r["generated_text"] for k, r in b.items()
    }


@pytest.mark.slow
def test_two_ranks_compile_and_each_loads_its_own_cache(model, tmp_path):
    """-tp 2 --compile: the warm-up traced a clock read in the collectives and failed; and
    neither rank kept a cache. Now each rank compiles once and saves its own entry (its rank
    in the key), and a second process with other pool and sequence sizes compiles no graph on
    rank 0 and loads both."""
    rows = [{"prompt": f"row {i} " + "word " * (i * 3 % 11)} for i in range(12)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cache = tmp_path / "cache"
    tp = ("-tp", 2)
    cold = _compiled_job(data, tmp_path / "a", model, cache, tmp_path / "tmp-a", 2048, 8, *tp)
    assert len(list(cache.glob("*/artifacts.bin"))) == 2  # one entry a rank
    warm = _compiled_job(data, tmp_path / "b", model, cache, tmp_path / "tmp-b", 4096, 5, *tp)
    assert (cold["compile_cache"], warm["compile_cache"]) == ("miss", "hit")
    assert cold["graphs_compiled"] >= 1 and warm["graphs_compiled"] == 0
    assert cold["compiled_token_share"] == warm["compiled_token_share"] == 1.0
    assert len(list(cache.glob("*/artifacts.bin"))) == 2
    a, b = rows_by_id(tmp_path / "a"), rows_by_id(tmp_path / "b")
    assert {k: r["generated_text"] for k, r in a.items()} == {
        k: r["generated_text"] for k, r in b.items()
    }
