"""A completion's prompt logprobs in vLLM's shape, for `RequestOutput.prompt_logprobs`: per
prompt token None for the first (it has no context), then {token id: Logprob} of the token and
its position's k likeliest alternatives (`SamplingParams(prompt_logprobs=k)`)."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.sequence import Completion


@dataclass(slots=True)
class Logprob:
    """vLLM's: a token's logprob, its rank in the vocabulary (1: the likeliest; None where
    not known: a token outside the k alternatives kept) and its text (None in prompt logprobs)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def as_vllm(prompt_ids: list[int], c: Completion | None) -> list[dict[int, Logprob] | None] | None:
    """c's prompt logprobs in vLLM's shape (None: c asked for none)."""
    if c is None or c.prompt_logprobs is None:
        return None
    tops = c.prompt_top_logprobs or [[]] * len(c.prompt_logprobs)
    out: list[dict[int, Logprob] | None] = [None]
    for tok, lp, top in zip(prompt_ids[1:], c.prompt_logprobs[1:], tops[1:], strict=True):
        d = {t: Logprob(v, rank) for rank, (t, v) in enumerate(top, 1)}
        d.setdefault(tok, Logprob(lp, None))
        out.append(d)
    return out
