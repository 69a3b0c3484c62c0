"""Stop strings: matched on decoded text, on the host, at the runner's sync points."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[list[int]], str]  # token ids -> text


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in text where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def tokens_to_keep(ids: list[int], stops: Sequence[str], decode: Detokenize) -> int | None:
    """The shortest prefix of ids whose text contains a stop string, or None.

    Called after every new token, so a row's earlier text held none: a new stop string ends
    in the last tokens. Only a tail of them is decoded unless it holds one (a stop string of
    k characters spans at most k tokens that decode to text, and a few that do not)."""
    tail = ids[-(2 * max(map(len, stops), default=0) + 4) :]
    if first_stop(decode(tail), stops) is None:
        return None
    lo, hi = 1, len(ids)  # binary search: containment is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(decode(ids[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def trim_at_stop(text: str, stops: Sequence[str]) -> str:
    i = first_stop(text, stops)
    return text if i is None else text[:i]
