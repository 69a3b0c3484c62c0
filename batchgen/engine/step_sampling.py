"""A step's sampling on the device and its outputs on the host: tokens drawn
(engine/sampler.py) from logits the grammar mask has already been applied to
(engine/decode_mask.py), their log-probabilities and, for rows that ask, their top
alternatives; then the one host read of the step.

A step pays only for what its rows ask: an all-greedy step with no ban, grammar or top
alternatives is an argmax and a log-sum-exp (`greedy_step`); no sort over the vocabulary unless
a row filters (top-k, top-p, min-p); the top alternatives only when a row keeps them. The
log-probabilities are `logit - logsumexp(logits)`: a reduction over the vocabulary, not a
(B, V) log-softmax written out."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.engine.sampler import (
    SamplingColumns,
    SamplingTensors,
    ban_tokens,
    plain_greedy,
    sample,
)
from batchgen.engine.sequence import MAX_TOP_LOGPROBS, Scheduled, TopLogprobs

# (token, logprob, its top alternatives where the sequence asks for them) per sampling
# sequence, in plan order
Sampled = list[tuple[int, float, TopLogprobs | None]]


def _logprobs(logits: torch.Tensor, tok: torch.Tensor, top: bool) -> tuple[torch.Tensor, ...]:
    lse = logits.logsumexp(-1, keepdim=True)  # (B, 1)
    lp = (logits.gather(-1, tok[:, None]) - lse)[:, 0]
    if not top:
        return tok, lp
    vals, ids = logits.topk(min(MAX_TOP_LOGPROBS, logits.shape[-1]), dim=-1)
    return tok, lp, vals - lse, ids


def greedy_step(logits: torch.Tensor, top: bool = False) -> tuple[torch.Tensor, ...]:
    """(tokens, their logprobs[, top logprobs, their ids]) of rows that are all greedy and
    ban nothing: the argmax (max's index: the first of equal maxima, as argmax's, from a
    reduction ~3x faster on the CPU)."""
    return _logprobs(logits, logits.max(-1).indices, top)


def sample_step(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    steps: torch.Tensor,
    greedy_only: bool,
    top: bool = False,
    filters: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(tokens, their logprobs) and, with top, the (B, MAX_TOP_LOGPROBS) likeliest logprobs
    and their token ids (of the same distribution: the model's, under the constraint and
    min_tokens' ban). filters: a row asks for top-k, top-p or min-p."""
    logits = ban_tokens(logits, sampling.ban)  # stop tokens below min_tokens get -inf
    tok = sample(logits, sampling, steps, greedy_only, filters)
    return _logprobs(logits, tok, top)


def sample_rows(
    logits: torch.Tensor,
    sampled: list[Scheduled],
    top: bool,
    compiled: Callable | None = None,
) -> tuple[torch.Tensor, ...]:
    """The rows `sampled` (logits' rows, in order) drawn, paying for what they ask: the argmax
    where all are plain greedy, else their columns through `compiled` (the compiled sampling,
    CompiledForward.sample) or eagerly."""
    if plain_greedy(sampled):
        return greedy_step(logits, top)
    sampling = SamplingColumns.of(sampled)
    if compiled is not None:
        return compiled(logits, sampling)
    samp, steps = sampling.tensors(logits.device)
    return sample_step(logits, samp, steps, sampling.greedy_only, top, sampling.filters)


def wants_top(sampled: list[Scheduled]) -> bool:
    """Does a sequence of the step keep its tokens' top alternatives?"""
    return any(s.seq.params.top_logprobs for s in sampled)


def to_host(result: tuple[torch.Tensor, ...], sampled: list[Scheduled], top: bool) -> Sampled:
    """The step's outputs for the sequences `sampled` (its first rows), on the host, in one
    read: tokens, logprobs and (where top) the alternatives side by side as float64 (exact for
    token ids below 2**53); their top alternatives only for the rows that ask."""
    n = len(sampled)
    cols = [result[0][:n, None].double(), result[1][:n, None].double()]
    if top:
        cols += [result[2][:n].double(), result[3][:n].double()]
    rows = torch.cat(cols, dim=1).tolist()  # the step's one device -> host read
    if not top:
        return [(int(t), lp, None) for t, lp in rows]
    width = result[2].shape[1]
    out: Sampled = []
    for s, row in zip(sampled, rows, strict=True):
        k = s.seq.params.top_logprobs
        alts = None
        if k:
            alts = [
                (int(i), v)
                for v, i in zip(row[2 : 2 + k], row[2 + width : 2 + width + k], strict=True)
            ]
        out.append((int(row[0]), row[1], alts))
    return out
