"""The warm-up, after the KV pool is allocated and before the first row is queued, so that
none of its costs lands in a row's TTFT.

Every engine first runs one prefill of `max_num_batched_tokens` tokens (spans of 128, every
key into the scratch block) and a decode of `max_num_seqs` rows (`step_inputs.warmup_eager`):
their first run pays what a process pays once (the allocator growing to a step's peak, the
math libraries' first calls). Compiled, those steps go through the graph, which the first
compiles, and on a GPU every CUDA-graph size is then recorded (engine/compiled_forward.py).
Eager on the CPU, one span and CPU_WARMUP_ROWS decode rows: the libraries' first calls are the
same, nothing there is sized from the peak, and a full-size prefill only repeats a real
step's work (2048 tokens of llama-55m: 2.4 CPU-seconds at one thread, about a tenth of a
96-row prompt-logprobs job's process; its first real step measured no slower after the short
warm-up, within the load's noise).
On a GPU the peak memory is measured from here (ModelRunner.kv_budget_bytes).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from batchgen.engine.sampler import SamplingColumns
from batchgen.engine.step_inputs import (
    WARMUP_SPAN,
    WarmUp,
    capture_sizes,
    token_sizes,
    warmup_decode,
    warmup_eager,
)
from batchgen.model.attention.step import DecodeBackend

# The runner: engine/model_runner.py's ModelRunner, which calls these (so not imported here).
Runner = Any
CPU_WARMUP_ROWS = 16  # the eager CPU warm-up's decode rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(runner: Runner, max_num_seqs: int, max_tokens: int) -> WarmUp:
    """The warm-up's steps through the runner (and the other tensor-parallel ranks)."""
    t0 = time.perf_counter()
    dev, bs, graph = runner.device, runner.block_size, runner.graph
    if dev.type == "cuda":  # the warm-up's peak sizes the pool (kv_budget_bytes)
        torch.cuda.reset_peak_memory_stats(dev)
    if graph is None and dev.type == "cpu":
        max_tokens, max_num_seqs = min(max_tokens, WARMUP_SPAN), min(max_num_seqs, CPU_WARMUP_ROWS)
    prefill, decode = warmup_eager(
        max_tokens, max_num_seqs, bs, runner.model.cfg.max_position_embeddings
    )
    if graph is None:
        for x in (prefill, decode):
            runner.run_warm(x)
        _sync(dev)
        return WarmUp(warmup_seconds=time.perf_counter() - t0)
    cuda = dev.type == "cuda"
    runner.build_graph(token_sizes(max_tokens) if cuda else [], capture_sizes(max_num_seqs))

    def run(tokens: int | None, mode: str) -> None:
        """One step, its rows sampled in mode (compiled_forward.SAMPLING_MODES)."""
        x = prefill if tokens is None else warmup_decode(min(tokens, max_num_seqs), tokens, bs)
        logits = runner.run_warm(x)
        sampling = SamplingColumns()
        rows = len(x.logits_index)
        sampling.pad(rows)
        if mode != "greedy":
            sampling.temperature[:] = [1.0] * rows
        if mode == "filtered":
            sampling.top_k[:] = [1] * rows
        graph.sample(logits, sampling)

    warm = graph.warm_up(run, max_num_seqs)
    if runner.broadcast is not None and graph.cache is not None:
        x = warmup_decode(2, 2, bs)  # the other ranks save theirs (each keeps its own)
        x.save_compile_cache = True
        runner.run_warm(x)
    return warm


def rewarm_attention(runner: Runner, max_num_seqs: int) -> None:
    """After the pool was replaced: flex's kernel is compiled per pool shape, so a decode of
    each power-of-two row count runs once more, before any row."""
    if runner.attention is not DecodeBackend.FLEX:
        return
    rows = 1
    while True:
        runner.run_warm(warmup_decode(rows, rows, runner.block_size))
        if rows >= max_num_seqs:
            break
        rows *= 2
    _sync(runner.device)
