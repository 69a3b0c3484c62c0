"""The report's figures about rows and time rather than steps: rows done and rows/s over the
job, and the phases the wall time went to (start-up, loading, compiling, capturing, prefill,
decode; page.py draws them as one bar).

Rows done over time come from the latency histogram: an offline job queues every row when
its engine starts, so a row's latency is when it was done, and the histogram's running count
is the number of rows done by then (to its 1% buckets). It covers the last run only (a resumed
job's earlier rows are not in it), and a merge's sums shards that each count from their own
start."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from batchgen.report.timebins import bin_count
from batchgen.stats.latency import LOW, RATIO, LogHistogram

# (stats key, label, colour) of the stacked bar, in the order the time is spent
PHASES = (
    ("startup_s", "start-up (imports, input checks)", "tab:gray"),
    ("load_s", "model load", "tab:brown"),
    ("compile_s", "compile", "tab:purple"),
    ("capture_s", "CUDA graph capture", "tab:pink"),
    ("warmup_s", "warm-up steps", "tab:olive"),
    ("prefill_s", "prefill steps", "tab:orange"),
    ("decode_s", "decode steps", "tab:blue"),
)


def rows_done(stats: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """(seconds, rows done by then), at each latency bucket's upper edge; None without rows."""
    hist = (stats.get("latency_histograms") or {}).get("latency_s")
    if not hist or not hist.get("counts"):
        return None
    counts = LogHistogram.from_dict(hist).counts
    idx = np.array(sorted(counts), dtype=np.float64)
    done = np.cumsum([counts[int(i)] for i in idx])
    return LOW * RATIO ** (idx + 1), done.astype(np.float64)


def draw_rows(ax: Axes, stats: dict[str, Any]) -> bool:
    """Rows done (cumulative) and rows/s in bins of time on ax; False without rows."""
    got = rows_done(stats)
    if got is None:
        return False
    t, done = got
    edges = np.linspace(0.0, float(t[-1]), bin_count(len(t)) + 1)
    # rows done by each edge: a step up at each bucket's upper edge (1% of its time)
    cum = np.concatenate([[0.0], done])[np.searchsorted(t, edges, side="right")]
    ax.plot(edges, cum, color="tab:green", label="rows done (cumulative)")
    ax.set(
        xlabel="seconds since the rows were queued (s)",
        ylabel="rows done",
        title="Rows done and rows/s over time (from each row's latency)",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    rate = ax.twinx()
    centres = (edges[:-1] + edges[1:]) / 2
    rate.plot(centres, np.diff(cum) / np.diff(edges), color="tab:blue", alpha=0.7, label="rows / s")
    rate.set(ylabel="rows / s")
    rate.set_ylim(bottom=0)
    handles = [h for a in (ax, rate) for h in a.get_legend_handles_labels()[0]]
    labels = [x for a in (ax, rate) for x in a.get_legend_handles_labels()[1]]
    ax.legend(handles, labels, loc="upper left", fontsize="small")
    return True


def rows_over_time(stats: dict[str, Any]) -> Figure | None:
    """The rows plot alone (a job without a step timeline)."""
    fig = Figure(figsize=(9.0, 3.6), dpi=100, layout="constrained")
    return fig if draw_rows(fig.add_subplot(), stats) else None


def phases(stats: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, seconds, colour) of each phase that took time, then "other" (reading input,
    writing parts, the scheduler) up to the whole job's wall time."""
    got = [(label, float(stats.get(k) or 0.0), c) for k, label, c in PHASES]
    gap = float((stats.get("host_gap_s") or {}).get("total") or 0.0)
    got.append(("the host between steps (a GPU's idle time)", gap, "tab:red"))
    got = [p for p in got if p[1] > 0]
    total = float(stats.get("total_wall_s") or 0.0) or float(
        (stats.get("startup_s") or 0.0) + (stats.get("wall_s") or 0.0)
    )
    rest = total - sum(s for _, s, _ in got)
    if rest > 0:
        got.append(("other (input, output)", rest, "tab:cyan"))
    return got
