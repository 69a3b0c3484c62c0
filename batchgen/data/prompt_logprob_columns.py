"""A prompt-logprobs job's result columns, in place of the generated text: each prompt token's
log-probability given the tokens before it (the first's null: it has no context, as in vLLM),
their sum negated (`prompt_nll`, nats) and the perplexity, exp of the mean negated logprob
(null for a one-token prompt); with --prompt-logprobs K each position's K likeliest tokens."""

from __future__ import annotations

import math
from typing import Any, Protocol

import pyarrow as pa

COLUMNS = ("prompt_logprobs", "prompt_nll", "perplexity", "prompt_top_logprobs")


class PromptScored(Protocol):
    """What the columns take from a row's result (the engine's Completion)."""

    prompt_logprobs: list[float | None] | None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None


def schema_fields(top: bool, top_type: pa.DataType) -> list[pa.Field]:
    """The columns' fields (top: with the alternatives, of top_type)."""
    types = (pa.list_(pa.float32()), pa.float64(), pa.float64(), top_type)[: 3 + top]
    return [pa.field(n, t) for n, t in zip(COLUMNS, types, strict=False)]


def record_fields(result: PromptScored | None, k: int) -> dict[str, Any]:
    """A record's columns from its result (None: an error row's nulls); k: alternatives kept."""
    names = COLUMNS[: 3 + (k > 0)]
    if result is None:
        return dict.fromkeys(names)
    lps = result.prompt_logprobs
    nll = -math.fsum(lps[1:])
    out = {
        names[0]: lps,
        names[1]: nll,
        names[2]: math.exp(nll / (len(lps) - 1)) if len(lps) > 1 else None,
    }
    if k:
        tops = result.prompt_top_logprobs
        out[names[3]] = [[{"id": i, "logprob": v} for i, v in t] for t in tops]
    return out
