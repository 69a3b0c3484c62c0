"""OUT/.batchgen/report.html: one self-contained page (the plots inline as PNG data URIs, the styles in
the page, nothing fetched), written atomically like every file in an output directory."""

from __future__ import annotations

import base64
import html
import io
import logging
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from batchgen.data.writer import REPORT_FILE, write_file
from batchgen.errors import InputError
from batchgen.report import plots
from batchgen.report.load import RunData, load

log = logging.getLogger(__name__)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.92em; }
td, th { padding: 0.25em 0.9em; border-bottom: 1px solid #ddd; text-align: left; }
td.v { font-variant-numeric: tabular-nums; }
img { max-width: 100%; } p.note { color: #555; font-size: 0.9em; max-width: 60em; }
p.warn { background: #fff4d6; border-left: 4px solid #e0a000; padding: 0.5em 0.9em; }
"""


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _ms(d: dict[str, Any] | None) -> str:
    if not d or d.get("p50") is None:
        return "-"
    return " / ".join(f"{d[q] * 1e3:.1f}" for q in ("p50", "p90", "p99", "max")) + " ms"


def _pct(x: float | None) -> str:
    return f"{x:.2%}" if x is not None else "- (no peak known)"


def stats_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The table of headline figures, from a run's or a merge's stats.json."""
    wall = s.get("wall_s", s.get("max_wall_s", 0.0))
    rows = [
        (
            "rows",
            f"{s.get('rows', 0)} ({s.get('rows_error', 0)} errors, {s.get('rows_skipped_done', 0)} from an earlier run)",
        ),
        ("wall time", f"{wall:.2f} s" + (" (slowest shard)" if "max_wall_s" in s else "")),
        ("output tokens/s", f"{s.get('output_tokens_per_s', 0.0):.1f}"),
        ("TTFT p50 / p90 / p99 / max", _ms(s.get("ttft_s"))),
        ("TPOT p50 / p90 / p99 / max", _ms(s.get("tpot_s"))),
        ("latency p50 / p90 / p99 / max", _ms(s.get("latency_s"))),
        ("MFU", _pct(s.get("mfu"))),
        ("MBU (decode steps)", _pct(s.get("mbu"))),
    ]
    if s.get("peak_flops"):
        peaks = (
            f"{s['peak_flops'] / 1e12:.3g} TFLOP/s, {(s.get('peak_bandwidth') or 0) / 1e9:.3g} GB/s"
        )
        rows.append(("peaks", f"{peaks} ({s.get('peak_source')})"))
    for key, name in (("prefill_s", "prefill time"), ("decode_s", "decode time")):
        if key in s:
            rows.append((name, f"{s[key]:.2f} s"))
    if "prefix_cache_hit_rate" in s:
        rows.append(("prefix cache hit rate", f"{s['prefix_cache_hit_rate']:.1%}"))
    if "preemptions" in s:
        rows.append(("preemptions", str(s["preemptions"])))
    if s.get("gpu_util_mean_pct") is not None:
        rows.append(
            ("GPU SM % mean / max", f"{s['gpu_util_mean_pct']:.0f}% / {s['gpu_util_max_pct']}%")
        )
        if s.get("gpu_mem_util_mean_pct") is not None:
            rows.append(
                (
                    "GPU memory busy mean / max",
                    f"{s['gpu_mem_util_mean_pct']:.0f}% / {s['gpu_mem_util_max_pct']}%",
                )
            )
        if s.get("gpu_power_mean_w") is not None:
            rows.append(
                (
                    "GPU power mean / max",
                    f"{s['gpu_power_mean_w']:.0f} W / {s['gpu_power_max_w']:.0f} W",
                )
            )
    for key in ("model", "device", "dtype", "max_num_seqs", "shards"):
        if s.get(key) is not None:
            rows.append((key.replace("_", " "), str(s[key])))
    return rows


def render(data: RunData) -> str:
    s = data.stats
    parts = [f"<h1>batchgen report: {html.escape(str(data.out))}</h1>"]
    parts += [f'<p class="warn">Note: {html.escape(n)}.</p>' for n in data.notes]
    if data.merged:
        parts.append(
            f'<p class="note">{s["shards"]} shards merged; the timeline puts them on one clock.</p>'
        )
    table = "".join(
        f"<tr><th>{html.escape(k)}</th><td class=v>{html.escape(v)}</td></tr>"
        for k, v in stats_rows(s)
    )
    parts += ["<h2>Summary</h2>", f"<table>{table}</table>"]
    parts.append(
        '<p class="note">TTFT, TPOT and latency count from when a row entered the engine\'s '
        "queue (an offline job queues every row at its start, so TTFT includes the wait). "
        "MFU: model FLOPs over step time / peak FLOP/s. MBU: bytes decode steps must read "
        "(weights + live KV) / decode time / peak bandwidth. See docs/metrics.md.</p>"
    )
    parts += ["<h2>Latency distributions</h2>", _png(plots.distributions(s))]
    if data.steps and len(data.steps["t_s"]):
        parts += ["<h2>Throughput</h2>", _png(plots.throughput(data.steps))]
        parts += ["<h2>Batch and KV cache</h2>", _png(plots.occupancy(data.steps))]
        parts += ["<h2>Roofline</h2>", _png(plots.roofline(data.steps, s))]
    else:
        parts.append('<p class="note">No step timeline here: no timeline to plot.</p>')
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>batchgen report</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def write_report(out: str | Path) -> Path:
    """Write OUT/.batchgen/report.html from OUT's statistics and timeline; its path."""
    data = load(out)
    try:
        page = render(data).encode()
    except (KeyError, TypeError, ValueError, IndexError) as e:  # a hand-edited or foreign file
        raise InputError(
            f"{data.out}'s statistics or step timeline do not hold what batchgen writes "
            f"({type(e).__name__}: {e}); run the job again to write them anew"
        ) from None
    write_file(data.out, REPORT_FILE, lambda f: f.write(page))
    for note in data.notes:
        log.warning("%s: %s", data.out, note)
    return data.out / REPORT_FILE
