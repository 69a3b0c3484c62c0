"""Compiled decoding at the GPU's defaults, on the CPU: one compile of the model per job,
compiled == eager, no recompiles in steady state, a fallback that keeps the job going, and a
compile cache that a second process loads.

The forward is compiled once over a symbolic batch with attention as an opaque op
(engine/compiled_decode.py, model/decode_ops.py), sampling is a small graph of its own, and a
warm-up compiles both before the first row. Compiling costs seconds on the CPU, so the
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

from batchgen.engine.compiled_decode import CompiledDecode
from batchgen.engine.compiled_step import CompiledStep
from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import ConstraintKind
from batchgen.engine.sequence import Constraint, FinishReason, Request, SamplingParams
from batchgen.engine.step_inputs import capture_sizes, padded_batch
from batchgen.llm import LLM
from batchgen.model.attention import DECODE_ATTENTION_ENV

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


@pytest.mark.slow
def test_a_mixed_job_compiles_the_model_once_and_equals_eager(model):
    """Greedy, sampled, constrained and top-logprob rows at every batch size from 1 to
    max_num_seqs: one model graph (sampling: one greedy, one sampled), tokens equal eager,
    and the same job again compiles nothing."""
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=ENGINE)
    _, want = _run(eager, _workload())
    llm = LLM(model, dtype="float32", device="cpu", compile=True, engine=ENGINE)
    reports, got = _run(llm, _workload())
    _same(got, want)
    warm = reports[0]
    assert warm.compile_seconds > 0 and not warm.finished and not warm.decode_rows
    decode = llm.runner.decode
    assert decode.graphs == 1  # the model, whatever the batch: 1 to 8 rows met
    assert decode.sample_graph.graphs == 2  # greedy-only, and with sampled rows
    sizes = {b for b, _ in llm.runner.shapes}
    assert sizes == {2, 4, 8}  # every padded size met, 1 row padded to 2
    assert all(r.compile_seconds == 0 for r in reports[1:])  # nothing after the warm-up
    for r in reports[1:]:
        if r.decode_rows and not r.prefill:
            assert r.decode_rows + r.padded_rows == padded_batch(r.decode_rows)

    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        _, again = _run(llm, _workload())
    assert events.n == 0 and again == got
    assert decode.graphs == 1


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flex_decode_at_block_16_equals_eager(tmp_path, monkeypatch, head_dim):
    """The CUDA path's attention (flex over the pool in place, its kernel compiled on its own
    at static power-of-two rows) inside the one symbolic graph, at the GPU's block size 16
    and the head dims of real models."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    path = save_tiny_model("llama", tmp_path / "m", head_dim=head_dim, num_key_value_heads=2)
    eager = LLM(path, dtype="float32", device="cpu", compile=False, engine=ENGINE)
    _, want = _run(eager, _workload(1))
    llm = LLM(path, dtype="float32", device="cpu", compile=True, engine=ENGINE)
    _, got = _run(llm, _workload(1))
    _same(got, want)
    assert llm.runner.decode.graphs == 1 and llm.runner.decode.forward_graph.dynamic


def _pinned_logits(self, tokens, positions, slots, *attn):
    if tokens.shape[0] == 2:  # a branch on the batch pins it: no symbolic graph
        tokens = tokens.clone()
    return _real_logits(self, tokens, positions, slots, *attn)


_real_logits = CompiledDecode._logits


@pytest.mark.slow
def test_a_failed_symbolic_compile_falls_back_and_the_job_goes_on(model, monkeypatch, caplog):
    """A graph that cannot be symbolic: the marks are cleared, one warning names the cost,
    every size compiles statically, and the job's tokens are eager's. Through the flex path,
    whose own static compile raised on the marked tensors before."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=ENGINE)
    _, want = _run(eager, _workload(2))
    monkeypatch.setattr(CompiledDecode, "_logits", _pinned_logits)
    llm = LLM(model, dtype="float32", device="cpu", compile=True, engine=ENGINE)
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.compiled_step"):
        _, got = _run(llm, _workload(2))
    _same(got, want)
    step = llm.runner.decode.forward_graph
    assert not step.dynamic
    assert caplog.text.count("one graph per batch size") == 1
    assert step.graphs == len({b for b, _ in llm.runner.shapes})  # a static graph a size


def _plus_row_index(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + torch.arange(x.shape[0])


def test_one_graph_serves_every_batch_size():
    step = CompiledStep(_plus_row_index, torch.device("cpu"), [(0,)])
    with CompileEvents() as events:
        for b in (8, 2, 4, 24, 2):
            assert step(torch.ones(b, dtype=torch.long)).tolist() == [2 + i for i in range(b)]
    assert events.n == 1 and step.dynamic and step.graphs == 1


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(256)[:6] == [2, 4, 8, 16, 24, 32] and capture_sizes(256)[-1] == 256
    assert len(capture_sizes(256)) == 34 and capture_sizes(1) == [2]
    for n in range(1, 257):
        b = padded_batch(n)
        assert b >= n and b in capture_sizes(256) and b in capture_sizes(max(n, 2))


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


def _compiled_job(data: Path, out: Path, model: Path, cache: Path, inductor: Path, kv: int):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}  # a fresh node's own caches
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
            8,
            "--kv-cache-tokens",
            kv,
            "--quiet",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return read_stats(out)


@pytest.mark.slow
def test_a_second_process_loads_the_compile_cache(model, tmp_path):
    """Cold: a miss, the graphs compiled and saved. Warm, in a new process with empty local
    caches and another KV pool size: a hit, nothing compiled after the warm-up, the same
    tokens, and compile_s well under cold's (a loose bound: the measured ratio, 0.22-0.26 on
    this tiny model, is scripts/bench_compile.py's and in docs/benchmarks.md)."""
    rows = [{"prompt": f"row {i} " + "word " * (i * 3 % 17)} for i in range(24)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cache = tmp_path / "cache"
    cold = _compiled_job(data, tmp_path / "a", model, cache, tmp_path / "ind-a", 2048)
    warm = _compiled_job(data, tmp_path / "b", model, cache, tmp_path / "ind-b", 4096)
    assert (cold["compile_cache"], warm["compile_cache"]) == ("miss", "hit")
    assert len(list(cache.glob("*/artifacts.bin"))) == 1
    assert cold["compiled_shapes"] == warm["compiled_shapes"] == 0  # no compile after warm-up
    assert warm["compile_s"] <= 0.5 * cold["compile_s"], (warm["compile_s"], cold["compile_s"])
    a, b = rows_by_id(tmp_path / "a"), rows_by_id(tmp_path / "b")
    assert {k: r["generated_text"] for k, r in a.items()} == {
        k: r["generated_text"] for k, r in b.items()
    }
