"""Finished sequences -> completions: the text (stop strings trimmed), a constrained row's
final verdict, the timings, each prompt token's logprob where a row asks (a prompt-logprobs
row's, which samples nothing, is its completion), and for the score task one completion per
request once all its candidates are in.

A scored request (`Request.candidates`) runs as one sequence per candidate, prompt +
candidate (`expand`); the scheduler has the first compute the prompt and the others hit its
blocks. The request completes, with each candidate's log-probability, when all have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from batchgen.engine.constraints import Constrainer
from batchgen.engine.sequence import Completion, FinishReason, Request, SeqState
from batchgen.engine.stopping import Detokenize, skipped, trim_at_stop


def expand(r: Request) -> list[Request]:
    """The sequences r runs as: itself, or one per candidate of a scored request."""
    if not r.candidates:
        return [r]
    n = r.prompt_len
    return [
        replace(r, prompt_ids=r.prompt_ids + list(c), candidates=(), score_from=n)
        for c in r.candidates
    ]


@dataclass(slots=True)
class _ScoredRow:
    """A scored request in flight: its candidates' log-probabilities as they finish."""

    request: Request
    scores: list[float | None]
    cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return all(x is not None for x in self.scores)


def error_completion(r: Request, error: str | None) -> Completion:
    return Completion(r.index, [], FinishReason.ERROR, r.prompt_len, error=error)


class Completions:
    def __init__(self, detokenize: Detokenize, constrainer: Constrainer | None) -> None:
        self.detokenize, self.constrainer = detokenize, constrainer
        self._candidates: dict[SeqState, tuple[_ScoredRow, int]] = {}  # seq -> (row, which)

    def scoring(self, r: Request, seqs: list[SeqState]) -> None:
        """seqs (expand(r), queued) score r's candidates."""
        row = _ScoredRow(r, [None] * len(seqs))
        for j, seq in enumerate(seqs):
            self._candidates[seq] = (row, j)

    def clear(self) -> None:
        """Forget the scored requests in flight (Engine.abort)."""
        self._candidates.clear()

    @property
    def scoring_in_flight(self) -> int:
        return len(self._candidates)

    def of(self, finished: list[SeqState], now: float) -> list[Completion]:
        """The completions of the sequences that finished in the step that ended at `now`."""
        return [c for seq in finished if (c := self._one(seq, now)) is not None]

    def _one(self, seq: SeqState, now: float) -> Completion | None:
        if seq in self._candidates:
            return self._scored(seq, now)
        if seq.finish_reason is FinishReason.ERROR:
            return error_completion(seq.request, seq.error)
        if seq.request.scoring:  # a prompt-logprobs or pooled row: nothing sampled
            return _with_prompt_logprobs(
                Completion(
                    index=seq.request.index,
                    token_ids=[],
                    finish_reason=FinishReason.STOP,
                    prompt_tokens=seq.prompt_len,
                    cached_tokens=seq.num_cached_prompt,
                    queued_at=seq.queued_at,  # its "first token" is its scores
                    first_token_at=now,
                    finished_at=now,
                    pooled=seq.pooled if seq.params.pooling is not None else None,
                ),
                seq,
            )
        ids, logprobs, top = seq.output_ids, seq.logprobs, seq.top_logprobs
        if seq.keep is not None:
            ids, logprobs, top = ids[: seq.keep], logprobs[: seq.keep], top[: seq.keep]
        # a stop token id stays in token_ids and out of the text, as in vLLM
        text = self.detokenize(ids[:-1] if isinstance(seq.stop_reason, int) else ids)
        if seq.params.stop and seq.finish_reason is FinishReason.STOP:
            skip = skipped(seq.params.min_tokens)  # no stop string ends before min_tokens
            after = len(self.detokenize(ids[:skip])) if skip else 0
            text = trim_at_stop(text, seq.params.stop, after)
        reason = seq.finish_reason
        error = seq.error if reason is FinishReason.LENGTH else None  # a constrained row's note
        if reason is FinishReason.STOP and seq.params.constraint is not None:  # never a bad stop
            cut = seq.keep is not None
            error = self.constrainer.final_error(seq.params.constraint, text, cut)
            if error is not None and not cut:  # the grammar let it through: not an answer
                return error_completion(seq.request, error)
        done = Completion(
            index=seq.request.index,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=seq.prompt_len,
            text=text,
            logprobs=logprobs,
            cached_tokens=seq.num_cached_prompt,
            top_logprobs=top if seq.params.top_logprobs else None,
            error=error,
            stop_reason=seq.stop_reason,
            queued_at=seq.queued_at,
            first_token_at=seq.first_token_at or now,
            finished_at=now,
        )
        return _with_prompt_logprobs(done, seq)

    def _scored(self, seq: SeqState, now: float) -> Completion | None:
        row, j = self._candidates.pop(seq)
        row.scores[j] = sum(seq.logprobs)
        row.cached_tokens += seq.num_cached_prompt
        if not row.done:
            return None
        r = row.request
        return Completion(
            index=r.index,
            token_ids=[],
            finish_reason=FinishReason.STOP,
            prompt_tokens=r.prompt_len,
            cached_tokens=row.cached_tokens,
            scores=row.scores,
            queued_at=seq.queued_at,  # a score row's "first token" is its scores
            first_token_at=now,
            finished_at=now,
        )


def _with_prompt_logprobs(c: Completion, seq: SeqState) -> Completion:
    """c with seq's prompt logprobs where its params ask: one per prompt token, the first's
    None (it has no context), as vLLM gives them."""
    k = seq.params.prompt_logprobs
    if k is not None:
        c.prompt_logprobs = [None, *seq.prompt_logprobs]
        c.prompt_top_logprobs = [[], *seq.prompt_top] if k else None
    return c
