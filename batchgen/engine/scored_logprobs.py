"""A step's scored positions -> log-probabilities: the runner's one hook for prefill-only
scoring (a score task's candidates, a row's prompt logprobs).

The LM head runs on the scored positions of this step's chunks only, so the logits are at
most (max_num_batched_tokens, vocab) whatever a prompt's length: a 32k-token prompt is
scored chunk by chunk, as it is prefilled (vLLM's prompt logprobs ran out of memory on long
prompts: vllm#5907). Within a step the head itself runs on `SLICE_ROWS` rows at a time
(`split_head`: one rank of a native model), each slice's logits taken through the
log-softmax before the next slice is made. A prompt-logprobs step on the CPU puts all its
2,048 tokens through the head: their logits at once were 262 MB of float32, above glibc's
32 MiB mmap ceiling (model/host_malloc.py), so each step faulted in and zeroed that much fresh
memory (384 `mixed` rows: 0.84-0.87M minor faults, 0.04M in slices) and wrote it past the
caches for the log-softmax to read back; a slice's logits reuse the last slice's memory. The
job's CPU time fell 6-8% (docs/benchmarks.md). Elsewhere (the transformers backend; tensor-
parallel ranks, whose head all-gathers in step) the step's logits are made at once and
scored a slice at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.sequence import ScoredChunk, StepPlan, TopLogprobs
from batchgen.model.families.transformer import Transformer

# Rows one slice scores: 256 x a 32k vocabulary is 31 MiB of float32 logits, under glibc's
# 32 MiB mmap ceiling, and the head's matmul runs as fast at 256 rows as at 2,048.
SLICE_ROWS = 256


@dataclass(slots=True)
class ScoredLogits:
    """The scored positions' float32 logits, rows lo:hi at a time (`rows(lo, hi)`)."""

    rows: Callable[[int, int], torch.Tensor]  # (lo, hi) -> (hi - lo, vocab)
    device: torch.device


def split_head(model: Transformer, h: torch.Tensor, index: torch.Tensor, n: int):
    """A step's hidden states h (T, dim) and its logits index -> the logits of the first n
    rows (the sampled ones; None: none) and the scored rows' after them, made a slice at a
    time by the model's head."""
    sampled = model.logits(h, index[:n]) if n else None
    rest = index[n:]
    return sampled, ScoredLogits(lambda lo, hi: model.logits(h, rest[lo:hi]), h.device)


def scored_after(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, ScoredLogits]:
    """A step's logits, made at once -> themselves and the scored rows' after the first n."""
    rest = logits[n:]
    return logits, ScoredLogits(lambda lo, hi: rest[lo:hi], logits.device)


def _top_k(plan: StepPlan) -> list[int]:
    """Each scored chunk's alternatives asked for, in plan order (0: none)."""
    return [
        s.seq.params.prompt_logprobs or 0 for s in plan.prefills if s.seq.request.scored is not None
    ]


def score_rows(
    logits: ScoredLogits, targets: list[int], chunks: list[list[int]], plan: StepPlan
) -> list[ScoredChunk]:
    """logits: the scored positions', in the order of chunks (each chunk's rows); targets:
    the token each row scores. Returns each chunk's log-probabilities of its targets and,
    where its row asks (`params.prompt_logprobs`), its rows' top alternatives."""
    ks = _top_k(plan)
    if not targets:
        return [ScoredChunk([]) for _ in chunks]
    want = torch.tensor(targets, device=logits.device)
    # each row's k: the rows of a chunk share their sequence's
    row_k = [k for rows, k in zip(chunks, ks, strict=True) for _ in rows]
    k_max = max(row_k)
    lps, top_v, top_i = [], [], []
    for lo in range(0, len(targets), SLICE_ROWS):
        lp = logits.rows(lo, lo + SLICE_ROWS).float().log_softmax(-1)  # (rows, vocab)
        lps.append(lp.gather(-1, want[lo : lo + SLICE_ROWS, None])[:, 0])
        if k_max:
            v, i = lp.topk(k_max, dim=-1)  # (rows, k_max), best first
            top_v.append(v)
            top_i.append(i)
    scored = torch.cat(lps).tolist()  # the host read
    tops: list[TopLogprobs | None] = [None] * len(targets)
    if k_max:
        values, ids = torch.cat(top_v).tolist(), torch.cat(top_i).tolist()
        rows = zip(ids, values, row_k, strict=True)
        tops = [list(zip(i[:k], v[:k], strict=True)) for i, v, k in rows]
    out, at = [], 0
    for rows, k in zip(chunks, ks, strict=True):
        end = at + len(rows)
        out.append(ScoredChunk(scored[at:end], tops[at:end] if k else None))
        at = end
    return out
