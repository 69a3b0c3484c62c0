"""What a step's tokens attended to, counted from its plan, for the roofline (stats/roofline.py).

The token at position p of a sequence attends to the keys of positions 0..p (p + 1 of them), or
with a sliding window of w to the last min(p + 1, w). A chunk of n tokens from position s
attends to the sum of that over p = s .. s + n - 1: with no window n*s + n(n+1)/2. A decode is a
chunk of one token. Plain Python over the plan's chunks: one addition per sequence a step.
"""

from __future__ import annotations

from batchgen.engine.sequence import StepPlan


def attended(start: int, n: int, window: int | None = None) -> int:
    """Keys attended by n tokens at positions start .. start + n - 1."""
    full = n * start + n * (n + 1) // 2
    if window is None or start + n <= window:
        return full
    # positions p >= window - 1 see exactly `window` keys; the ones before see p + 1
    capped = max(0, start + n - max(start, window - 1))  # positions at or past the cap
    head = n - capped
    return head * start + head * (head + 1) // 2 + capped * window


def context_tokens(plan: StepPlan, window: int | None = None) -> int:
    """Keys attended by every token the step computes (decodes and prefill chunks)."""
    if window is None:  # a decode at position p attends to p + 1 keys
        decodes = sum(s.start for s in plan.decodes) + len(plan.decodes)
    else:
        decodes = sum(min(s.start + 1, window) for s in plan.decodes)
    return decodes + sum(attended(s.start, s.num_tokens, window) for s in plan.prefills)
