"""The timeline's steps in bins of time, for the report's over-time plots.

A step ends at `t_s` after `step_s` of model time, so its tokens were computed over
[t_s - step_s, t_s]. Each series is integrated as a piecewise-linear running total over those
intervals (flat between steps), read at the bin edges with np.interp, and differenced: a bin
gets the share of each step that overlaps it. So any number of bins works for any number of
steps (a 2-step score run fills every bin its steps cover; a million steps cost one sort),
and a rate is never one step's tokens divided by a bin it barely touched. Merged shards run
side by side: each shard is integrated on its own and the totals are added.

`bin_count`: one bin per step for short jobs, within [MIN_BINS, MAX_BINS] for any job.
"""

from __future__ import annotations

import numpy as np

MIN_BINS, MAX_BINS = 60, 200


def bin_count(steps: int) -> int:
    return int(min(MAX_BINS, max(MIN_BINS, steps)))


def edges(steps: dict[str, np.ndarray], n: int | None = None) -> np.ndarray:
    """n + 1 bin edges from the first step's start to the last step's end."""
    t = np.asarray(steps["t_s"], dtype=np.float64)
    start = float(np.min(t - np.asarray(steps["step_s"], dtype=np.float64)))
    end = float(t.max())
    if end <= start:
        end = start + 1e-3
    return np.linspace(max(0.0, start), end, (n or bin_count(len(t))) + 1)


def _running_total(a: np.ndarray, b: np.ndarray, v: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The sum of v, each spread evenly over [a, b], accumulated up to each time in `at`."""
    order = np.argsort(b, kind="stable")
    a, b, v = a[order], b[order], v[order]
    a = np.minimum(np.maximum(a, np.concatenate([[-np.inf], b[:-1]])), b)  # no overlaps
    total = np.cumsum(v)
    xs = np.empty(2 * len(b))
    ys = np.empty(2 * len(b))
    xs[0::2], xs[1::2] = a, b
    ys[0::2] = total - v  # before the step
    ys[1::2] = total
    return np.interp(at, xs, ys, left=0.0, right=float(total[-1]) if len(total) else 0.0)


def integrate(
    steps: dict[str, np.ndarray], values: dict[str, np.ndarray], bin_edges: np.ndarray
) -> dict[str, np.ndarray]:
    """Each series' amount per bin, with "busy_s": the step seconds in each bin (all shards)."""
    t = np.asarray(steps["t_s"], dtype=np.float64)
    dur = np.asarray(steps["step_s"], dtype=np.float64)
    shard = np.asarray(steps["shard"]) if "shard" in steps else np.zeros(len(t), np.int64)
    series = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
    series["busy_s"] = dur
    out = {k: np.zeros(len(bin_edges) - 1) for k in series}
    for s in np.unique(shard):
        idx = shard == s
        a, b = t[idx] - dur[idx], t[idx]
        for k, v in series.items():
            out[k] += np.diff(_running_total(a, b, v[idx], bin_edges))
    return out


def rates(
    steps: dict[str, np.ndarray], values: dict[str, np.ndarray], n: int | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Bin centres and each series' amount per second of wall time in each bin."""
    e = edges(steps, n)
    got = integrate(steps, values, e)
    width = np.diff(e)
    return (e[:-1] + e[1:]) / 2, {k: v / width for k, v in got.items() if k != "busy_s"}


def means(
    steps: dict[str, np.ndarray], values: dict[str, np.ndarray], n: int | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Bin centres and each series' mean over the step time in each bin (time-weighted; NaN in
    bins without a step, so that a plotted line breaks where nothing ran)."""
    e = edges(steps, n)
    dur = np.asarray(steps["step_s"], dtype=np.float64)
    got = integrate(steps, {k: np.asarray(v) * dur for k, v in values.items()}, e)
    busy = got.pop("busy_s")
    idle = busy <= 1e-9 * np.diff(e)
    busy[idle] = np.nan
    return (e[:-1] + e[1:]) / 2, {k: v / busy for k, v in got.items()}
