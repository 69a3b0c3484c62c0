"""A step's sampling on the device and its outputs on the host: the grammar mask applied,
tokens drawn (engine/sampler.py), their log-probabilities and, for rows that ask, their top
alternatives; then the one host read of the step."""

from __future__ import annotations

import torch

from batchgen.engine.constraints import apply_bitmask
from batchgen.engine.sampler import SamplingTensors, ban_tokens, sample
from batchgen.engine.sequence import MAX_TOP_LOGPROBS, Scheduled, TopLogprobs

# (token, logprob, its top alternatives where the sequence asks for them) per sampling
# sequence, in plan order
Sampled = list[tuple[int, float, TopLogprobs | None]]


def sample_step(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    steps: torch.Tensor,
    greedy_only: bool,
    bitmask: torch.Tensor | None,
    top: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(tokens, their logprobs) and, with top, the (B, MAX_TOP_LOGPROBS) likeliest logprobs
    and their token ids (of the same distribution: the model's, under the constraint and
    min_tokens' ban)."""
    if bitmask is not None:  # constrained rows: tokens outside their grammar get -inf
        logits = apply_bitmask(logits, bitmask)
    logits = ban_tokens(logits, sampling.ban)  # stop tokens below min_tokens get -inf
    tok = sample(logits, sampling, steps, greedy_only)
    logp = logits.log_softmax(-1)
    lp = logp.gather(-1, tok[:, None])[:, 0]
    if not top:
        return tok, lp
    return tok, lp, *logp.topk(min(MAX_TOP_LOGPROBS, logp.shape[-1]), dim=-1)


def wants_top(sampled: list[Scheduled]) -> bool:
    """Does a sequence of the step keep its tokens' top alternatives?"""
    return any(s.seq.params.top_logprobs for s in sampled)


def to_host(result: tuple[torch.Tensor, ...], sampled: list[Scheduled], top: bool) -> Sampled:
    """The step's outputs for the sequences `sampled` (its first rows), on the host; their top
    alternatives only where top (a row asks)."""
    n = len(sampled)
    toks, lps = result[0][:n].tolist(), result[1][:n].tolist()
    if not top:
        return [(t, lp, None) for t, lp in zip(toks, lps, strict=True)]
    vals, ids = result[2][:n].tolist(), result[3][:n].tolist()
    out: Sampled = []
    for i, s in enumerate(sampled):
        k = s.seq.params.top_logprobs
        top = list(zip(ids[i][:k], vals[i][:k], strict=True)) if k else None
        out.append((toks[i], lps[i], top))
    return out
