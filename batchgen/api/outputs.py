"""What `LLM.generate` and `LLM.chat` return, shaped as vLLM's: one `RequestOutput` per
prompt, its samples as `CompletionOutput`s, and per-token `Logprob`s where asked for. The
engine's record of each sample (timings, cache hits, every token's logprob) stays on
`CompletionOutput.completion`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from batchgen.api.sampling import SamplingParams
from batchgen.engine.params import DecodeParams
from batchgen.engine.sequence import Completion, FinishReason
from batchgen.job.prompt_logprobs import Logprob, as_vllm


@dataclass(slots=True)
class CompletionOutput:
    """One sample, as vLLM's: `text`, `token_ids`, `cumulative_logprob` (the sum of its
    tokens' logprobs), `logprobs` (None unless SamplingParams(logprobs=k): then per token a
    {token id: Logprob} of the token and its k likeliest alternatives), `finish_reason`
    ("stop", "length"; "error" with `error` for a row the engine refused), `stop_reason`."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    error: str | None
    completion: Completion  # the engine's record (timings, cached tokens, scores)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return True


Decode = Callable[[list[int], bool], str]  # (token ids, skip special tokens) -> text


def completion_output(
    c: Completion, k: int, sp: DecodeParams, decode: Decode
) -> CompletionOutput | Completion:
    """The engine's completion c as sample k of a request under sp: vLLM's CompletionOutput
    for vLLM's SamplingParams; for the engine's own DecodeParams (batchgen's tests and
    scripts drive the engine with them), the engine's record itself."""
    if not isinstance(sp, SamplingParams):
        c.index = k
        return c
    text = c.text
    if not sp.skip_special_tokens and c.token_ids:
        text = _with_special_tokens(c, decode)
    if sp.include_stop_str_in_output and isinstance(c.stop_reason, str):
        text += c.stop_reason
    logprobs = None
    if sp.logprobs is not None and c.logprobs is not None:
        logprobs = _token_logprobs(c, decode)
    return CompletionOutput(
        index=k,
        text=text,
        token_ids=c.token_ids,
        cumulative_logprob=sum(c.logprobs) if c.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        error=c.error,
        completion=c,
    )


def _with_special_tokens(c: Completion, decode: Decode) -> str:
    """c's text with its special tokens (a stop token id stays out, as in vLLM)."""
    ids = c.token_ids[:-1] if isinstance(c.stop_reason, int) else c.token_ids
    text = decode(ids, False)
    if isinstance(c.stop_reason, str) and c.stop_reason in text:  # cut where the stop was
        text = text[: text.index(c.stop_reason)]
    return text


def _token_logprobs(c: Completion, decode: Decode) -> list[dict[int, Logprob]]:
    """Per generated token: its own Logprob, then its alternatives' (best first)."""
    out = []
    tops = c.top_logprobs or [[] for _ in c.token_ids]
    for tok, lp, top in zip(c.token_ids, c.logprobs, tops, strict=False):
        ranks = {t: r for r, (t, _) in enumerate(top, 1)}
        d = {tok: Logprob(lp, ranks.get(tok), decode([tok], False))}
        for t, alt in top:
            d.setdefault(t, Logprob(alt, ranks[t], decode([t], False)))
        out.append(d)
    return out


_OUTPUT_NAMES = frozenset(f.name for f in (*fields(CompletionOutput), *fields(Completion))) | {
    "completion_tokens"
}


@dataclass(slots=True)
class RequestOutput:
    """One prompt's results, shaped like vLLM's: `outputs` holds its n samples
    (`CompletionOutput`, in sample order; the engine's `Completion` records where the call
    passed the engine's DecodeParams). The first sample's fields also read on the result
    itself (`out.text`, `out.finish_reason`: the names batchgen's generate returned before)."""

    index: int  # the prompt's place in the call
    prompt: str | None  # None: given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput | Completion]

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def finished(self) -> bool:
        return True

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """With `SamplingParams(prompt_logprobs=k)`: vLLM's shape (job/prompt_logprobs.py)."""
        first = self.outputs[0] if self.outputs else None
        c = first.completion if isinstance(first, CompletionOutput) else first
        return as_vllm(self.prompt_token_ids, c)

    def __getattr__(self, name: str) -> Any:
        if name in _OUTPUT_NAMES:
            return getattr(self.outputs[0], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
