"""The report's step plots, drawn with matplotlib's object API (a `Figure` per plot, no pyplot
state, the Agg renderer): throughput over time, rows and KV blocks over time, the latency
distributions, and each step's time against its tokens under the compute and bandwidth
ceilings (the roofline view of MFU and MBU).

Long runs have millions of steps: time series go into bins of time (timebins.py: 60 to 200
over the job, one per step for short jobs) and the roofline scatter keeps every k-th step, so
a plot costs the same for any run. No latency "targets" are drawn: the usual ones (TTFT under
500 ms ...) are online serving's, and an offline job queues every row at its start, so every
row of a long job would look failed against them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from batchgen.report import timebins
from batchgen.report.tables import prefill_only
from batchgen.stats.latency import LOW, RATIO, LogHistogram
from batchgen.stats.roofline import compute_ceiling_s

MAX_POINTS = 20_000  # steps drawn in the roofline scatter
NAMES = {"ttft_s": "time to first token", "tpot_s": "time per output token", "latency_s": "latency"}


def _seconds(x: float, _pos: object = None, precise: bool = False) -> str:
    """A tick or label in ms below a second, in s above (3 significant digits if precise)."""
    fmt = ".3g" if precise else "g"
    return f"{x * 1e3:{fmt}} ms" if x < 1 else f"{x:{fmt}} s"


def _figure(width: float = 9.0, height: float = 3.6) -> Figure:
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def throughput(steps: dict[str, list], stats: dict[str, Any]) -> Figure:
    """Tokens/s over the job's time. Rows done over time (charts.py) is a figure of its own:
    its clock starts when the rows were queued, not when the job started."""
    fig = _figure()
    ax = fig.add_subplot()
    if prefill_only(stats):
        t, rates = timebins.rates(steps, {"prefill": steps["prefill_tokens"]})
        ax.plot(t, rates["prefill"], color="tab:orange", label="prompt tokens/s computed")
        ax.set(xlabel="seconds since the job started (s)", ylabel="prompt tokens / s")
        ax.set_title("Throughput over time (prefill only: nothing sampled)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        return fig
    t, rates = timebins.rates(
        steps,
        {
            "decode": steps.get("sampled_tokens", steps["decode_rows"]),
            "prefill": steps["prefill_tokens"],
        },
    )
    ax.plot(t, rates["decode"], color="tab:blue", label="output tokens/s (tokens sampled)")
    ax.set(xlabel="seconds since the job started (s)", ylabel="output tokens / s")
    ax.set_title("Throughput over time")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    prompt = ax.twinx()
    prompt.plot(
        t, rates["prefill"], color="tab:orange", alpha=0.6, label="prompt tokens/s computed"
    )
    prompt.set(ylabel="prompt tokens / s")
    prompt.set_ylim(bottom=0)
    _legend(ax, prompt)
    return fig


def _legend(*axes) -> None:
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    labels = [x for ax in axes for x in ax.get_legend_handles_labels()[1]]
    axes[0].legend(handles, labels, loc="best", fontsize="small")


def occupancy(steps: dict[str, list], decodes: bool = True) -> Figure:
    """Rows decoding (decodes: the job sampled) and waiting, and the KV cache's use."""
    fig = _figure()
    ax = fig.add_subplot()
    used = np.asarray(steps["kv_blocks_used"], dtype=np.float64)
    total = used + np.asarray(steps["kv_blocks_free"], dtype=np.float64)
    pct = np.divide(100 * used, total, out=np.zeros_like(used), where=total > 0)
    t, means = timebins.means(
        steps, {"rows": steps["decode_rows"], "waiting": steps["waiting"], "kv": pct}
    )
    if decodes:
        ax.plot(t, means["rows"], color="tab:blue", label="decoding rows")
    ax.plot(t, means["waiting"], color="tab:gray", alpha=0.7, label="waiting rows")
    ax.set(
        xlabel="seconds since the job started (s)",
        ylabel="rows",
        title="Batch and KV cache over time",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    kv = ax.twinx()
    kv.plot(t, means["kv"], color="tab:red", label="KV blocks used (%)")
    kv.set(ylabel="KV blocks used (%)", ylim=(0, 105))
    _legend(ax, kv)
    return fig


def distributions(stats: dict[str, Any]) -> Figure:
    """TTFT, TPOT and latency; a prefill-only job's latency alone (its TTFT is its latency)."""
    keys = ("latency_s",) if prefill_only(stats) else ("ttft_s", "tpot_s", "latency_s")
    fig = _figure(4.0 * len(keys), 3.4)
    hists = stats.get("latency_histograms") or {}
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        ax.set(title=NAMES[key], xlabel="seconds (log scale; ms, s)", ylabel="rows")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(_seconds))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        if key not in hists or not hists[key]["counts"]:
            # TPOT needs a second token: rows of one token have none
            empty = "no rows of 2 tokens or more" if key == "tpot_s" else "no rows"
            ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
            continue
        h = LogHistogram.from_dict(hists[key])
        # 1% buckets, 10 to a bar: ~10% wide on the log axis
        bars: dict[int, int] = {}
        for j, c in h.counts.items():
            bars[j // 10] = bars.get(j // 10, 0) + c
        lo, hi = min(bars), max(bars)
        counts = [bars.get(b, 0) for b in range(lo, hi + 1)]
        edges = [LOW * RATIO ** (10 * b) for b in range(lo, hi + 2)]
        ax.stairs(counts, edges, fill=True, alpha=0.6, color="tab:blue")
        s = h.summary()
        ax.axvline(
            s["p50"], color="black", ls="--", lw=1, label=f"p50 {_seconds(s['p50'], precise=True)}"
        )
        ax.axvline(
            s["p99"], color="black", ls=":", lw=1, label=f"p99 {_seconds(s['p99'], precise=True)}"
        )
        ax.set_xlim(edges[0] / 1.5, edges[-1] * 1.5)
        ax.legend(fontsize="x-small", loc="upper left")
    return fig


def roofline(steps: dict[str, list], stats: dict[str, Any]) -> Figure:
    fig = _figure(9.0, 4.2)
    ax = fig.add_subplot()
    n = len(steps["t_s"])
    k = max(1, n // MAX_POINTS)
    prompt = np.asarray(steps["prefill_tokens"])[::k]
    tokens = np.asarray(steps["decode_rows"])[::k] + prompt
    step_s = np.asarray(steps["step_s"])[::k]
    decodes = not prefill_only(stats)
    for prefill, colour, label in (
        (False, "tab:blue", "decode-only steps"),
        (True, "tab:orange", "steps with prefill"),
    )[1 - decodes :]:
        idx = (prompt > 0) == prefill
        ax.scatter(
            tokens[idx],
            step_s[idx],
            s=6,
            alpha=0.5,
            color=colour,
            label=label,
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tokens computed in the step (tokens)",
        ylabel="step time (ms, s)",
    )
    ax.yaxis.set_major_formatter(FuncFormatter(_seconds))
    ax.set_title("Step time against tokens per step, under the hardware's ceilings")
    bw, weights = stats.get("peak_bandwidth"), stats.get("weights_read_bytes")
    if compute_ceiling_s(stats, 1, 1) and bw and weights and len(tokens):
        xs = [1.0, float(tokens.max()) * 2.0]
        xs = [xs[0] * (xs[1] / xs[0]) ** (i / 50) for i in range(51)]
        # A decode step's every row goes through the LM head, a prefill step's last prompt
        # token only (at least one row), a prompt-logprobs prefill's every token; a pooled
        # job's head is a classifier's or none (stats/roofline.py).
        every = stats.get("head_on_every_prompt_token", False)
        decode = [compute_ceiling_s(stats, x, x) for x in xs]
        compute = [compute_ceiling_s(stats, x, x if every else 1) for x in xs]
        memory = weights / bw
        if decodes:
            label = "compute ceiling, decode (FLOPs / peak)"
            ax.plot(xs, decode, color="tab:green", lw=1, ls=":", label=label)
        ax.plot(
            xs,
            compute,
            color="tab:green",
            lw=1,
            ls="--",
            label=f"compute ceiling, prefill ({_prefill_head(stats)})",
        )
        ax.axhline(
            memory, color="tab:purple", lw=1, ls="--", label="bandwidth ceiling (weights / peak)"
        )
        ax.plot(
            xs,
            [max(c, memory) for c in compute],
            color="black",
            lw=1.5,
            label="fastest possible step",
        )
    else:
        ax.text(
            0.02,
            0.95,
            "no peaks known: pass --peak-tflops / --peak-bandwidth-gbs",
            transform=ax.transAxes,
            va="top",
            fontsize="small",
        )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="lower right")
    return fig


def _prefill_head(stats: dict[str, Any]) -> str:
    """What the prefill ceiling charges after the decoder (stats.json's head keys)."""
    head = stats.get("head", "lm")
    if head == "none":
        return "no head"
    if head == "classifier":
        return "one row's classifier head"
    every = stats.get("head_on_every_prompt_token")
    return "every token's LM head" if every else "one row's LM head"
