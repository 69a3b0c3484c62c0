"""Stop strings and stop token ids: matched on the host, at the runner's sync points.

With min_tokens (vLLM's semantics), nothing ends a row before its min_tokens-th token: its
stop tokens are not drawn (engine/sampler.py bans them), and a stop string counts only where
it ends in the text of that token or a later one (`skip`: the tokens before it).

Stop token ids end a row in the scheduler (`token_finish`); stop strings need the text, so the
engine asks `StopStrings` after each step for the rows whose text now holds one."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from batchgen.engine.sequence import FinishReason, SeqState, StepPlan

Detokenize = Callable[[list[int]], str]  # token ids -> text


def _hits(text: str, stops: Sequence[str], after: int) -> list[tuple[int, str]]:
    """(start, stop string) of each stop string's first occurrence ending past `after`."""
    found = ((text.find(s, max(0, after - len(s) + 1)), s) for s in stops if s)
    return [(i, s) for i, s in found if i >= 0]


def first_stop(text: str, stops: Sequence[str], after: int = 0) -> int | None:
    """Index in text where the earliest stop string (ending past `after`) starts, or None."""
    hits = _hits(text, stops, after)
    return min(hits)[0] if hits else None


def matched_stop(text: str, stops: Sequence[str], after: int = 0) -> str | None:
    """The stop string that first_stop finds (the earliest; of two there, the first given)."""
    hits = _hits(text, stops, after)
    if not hits:
        return None
    start = min(hits)[0]
    return next(s for i, s in hits if i == start)


def skipped(params_min_tokens: int) -> int:
    """Generated tokens whose text no stop string may end in: those before the min_tokens-th."""
    return max(0, params_min_tokens - 1)


def tokens_to_keep(
    ids: list[int], stops: Sequence[str], decode: Detokenize, skip: int = 0
) -> int | None:
    """The shortest prefix of ids whose text holds a stop string (ending past the text of
    ids[:skip]), or None.

    Called after every new token, so a row's earlier text held none: a new stop string ends
    in the last tokens. Only a tail of them is decoded unless it holds one (a stop string of
    k characters spans at most k tokens that decode to text, and a few that do not)."""
    tail = ids[-(2 * max(map(len, stops), default=0) + 4) :]
    after = len(decode(ids[:skip])) if skip else 0
    if len(ids) - skip >= len(tail):  # the tail is all past the skipped tokens
        if first_stop(decode(tail), stops) is None:
            return None
    elif first_stop(decode(ids), stops, after) is None:
        return None
    lo, hi = max(1, skip + 1), len(ids)  # binary search: containment is monotone in the prefix
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(decode(ids[:mid]), stops, after) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo if first_stop(decode(ids[:lo]), stops, after) is not None else None


def trim_at_stop(text: str, stops: Sequence[str], after: int = 0) -> str:
    i = first_stop(text, stops, after)
    return text if i is None else text[:i]


def token_finish(
    seq: SeqState, tok: int, eos: Collection[int]
) -> tuple[FinishReason | None, int | None]:
    """Does the token just appended to seq end it, and why: (STOP, None) at EOS (as vLLM, no
    stop_reason), (STOP, tok) at a stop token id, (LENGTH, None) at max_new_tokens, else
    (None, None). Below min_tokens neither stop kind counts (it was banned anyway)."""
    p = seq.params
    if not p.min_tokens or not seq.below_min_tokens:
        if tok in eos and not p.ignore_eos:
            return FinishReason.STOP, None
        if tok in p.stop_token_ids:
            return FinishReason.STOP, tok
    if seq.num_generated >= p.max_new_tokens:
        return FinishReason.LENGTH, None
    return None, None


@dataclass(slots=True, frozen=True)
class StopHit:
    """A row whose text holds one of its stop strings: it ends `stop` with `keep` tokens."""

    seq: SeqState
    keep: int  # output tokens kept: the shortest prefix whose text holds the stop string
    stop: str | None  # that stop string (the earliest in the text)


@dataclass(slots=True, frozen=True)
class StopStrings:
    """The stop strings of a step's rows, matched on the host after the step."""

    detokenize: Detokenize

    def hits(self, plan: StepPlan, finished: Collection[SeqState]) -> list[StopHit]:
        """The rows that sampled a token this step, have stop strings, did not end on that
        token and are past min_tokens, whose text now holds a stop string."""
        rows = [
            s.seq
            for s in plan.scheduled
            if s.samples and s.seq.params.stop and s.seq not in finished
            if not s.seq.below_min_tokens
        ]
        return [hit for seq in rows if (hit := self._hit(seq)) is not None]

    def _hit(self, seq: SeqState) -> StopHit | None:
        skip, stops, detokenize = skipped(seq.params.min_tokens), seq.params.stop, self.detokenize
        keep = tokens_to_keep(seq.output_ids, stops, detokenize, skip)
        if keep is None:
            return None
        text = detokenize(seq.output_ids[:keep])
        after = len(detokenize(seq.output_ids[:skip])) if skip else 0
        return StopHit(seq, keep, matched_stop(text, stops, after))
