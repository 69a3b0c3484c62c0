"""OUT/.batchgen/report.html: one self-contained page (the plots inline as PNG data URIs, the
styles in the page, nothing fetched), written atomically like every file in an output directory."""

from __future__ import annotations

import base64
import html
import io
import logging
from pathlib import Path
from typing import Any

from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from batchgen.data.writer import REPORT_FILE, write_file
from batchgen.errors import InputError
from batchgen.report import charts, plots, tables
from batchgen.report.load import RunData, load
from batchgen.report.rerun import rerun_command

log = logging.getLogger(__name__)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.92em; }
td, th { padding: 0.25em 0.9em; border-bottom: 1px solid #ddd; text-align: left; }
td.v { font-variant-numeric: tabular-nums; } th { font-weight: 600; }
div.bar { display: flex; height: 1.6em; width: 100%; max-width: 60em; }
div.bar span { display: block; } span.key { display: inline-block; width: 0.9em;
height: 0.9em; margin: 0 0.3em 0 1em; vertical-align: middle; }
pre, code { font-size: 0.9em; white-space: pre-wrap; }
img { max-width: 100%; } p.note { color: #555; font-size: 0.9em; max-width: 60em; }
p.warn { background: #fff4d6; border-left: 4px solid #e0a000; padding: 0.5em 0.9em; }
"""


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(k)}</th><td class=v>{html.escape(v)}</td></tr>" for k, v in rows
    )
    return f"<table>{cells}</table>"


def _figure(fig: Figure | None, missing: str) -> str:
    return _png(fig) if fig is not None else f'<p class="note">{html.escape(missing)}</p>'


def _time_bar(s: dict[str, Any]) -> str:
    """The phases as one stacked bar of the job's wall time (HTML, no image)."""
    parts = charts.phases(s)
    total = sum(sec for _, sec, _ in parts)
    if not total:
        return '<p class="note">No phase was timed.</p>'
    cells = "".join(
        f'<span style="width:{100 * sec / total:.2f}%;background:{to_hex(c)}" '
        f'title="{html.escape(label)}: {sec:.2f} s"></span>'
        for label, sec, c in parts
    )
    keys = " ".join(
        f'<span class="key" style="background:{to_hex(c)}"></span>{html.escape(label)}'
        for label, _, c in parts
    )
    return f'<div class="bar">{cells}</div><p class="note">{keys}</p>'


def _outcomes(data: RunData) -> list[str]:
    """Finish reasons and the errors, grouped, with examples."""
    parts = ["<h2>How the rows ended</h2>"]
    o = data.outcomes
    if o is None:
        return [*parts, '<p class="note">No part files with a finish_reason column.</p>']
    parts.append(_table(tables.outcome_rows(o)))
    reasons = data.stats.get("error_reasons") or {}
    if o.errors:
        parts.append("<h3>Errors by reason (numbers as N), with examples</h3>")
        items = []
        for group, (n, examples) in sorted(o.errors.items(), key=lambda kv: -kv[1][0]):
            shown = "".join(
                f"<li>row {html.escape(i)}: <code>{html.escape(t)}</code></li>" for i, t in examples
            )
            items.append(f"<li>{n} x <code>{html.escape(group)}</code><ul>{shown}</ul></li>")
        parts.append(f"<ul>{''.join(items)}</ul>")
    elif reasons:
        rows = [(r, str(n)) for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
        parts += ["<h3>Errors by reason (last run)</h3>", _table(rows)]
    else:
        parts.append('<p class="note">No row failed.</p>')
    return parts


def _job(data: RunData) -> list[str]:
    if not data.job:
        return []
    return [
        "<h2>Job</h2>",
        f"<pre>{html.escape(rerun_command(data.job, data.merged))}</pre>",
        "<details><summary>every option (job.json)</summary>",
        _table(tables.option_rows(data.job)),
        "</details>",
    ]


def render(data: RunData) -> str:
    s = data.stats
    parts = [f"<h1>batchgen report: {html.escape(str(data.out))}</h1>"]
    parts += [f'<p class="warn">Note: {html.escape(n)}.</p>' for n in data.notes]
    if data.merged:
        parts.append(
            f'<p class="note">{s["shards"]} shards merged; the timeline puts them on one clock.</p>'
        )
    parts += ["<h2>Summary</h2>", _table(tables.stats_rows(s))]
    parts.append(
        '<p class="note">TTFT, TPOT and latency count from when a row entered the engine\'s '
        "queue (an offline job queues every row at its start, so TTFT includes the wait). "
        "MFU: model FLOPs over step time / peak FLOP/s. MBU: bytes decode steps must read "
        "(weights + live KV) / decode time / peak bandwidth. See docs/metrics.md.</p>"
    )
    parts += ["<h2>Where the time went</h2>", _table(tables.time_rows(s))]
    parts.append(_time_bar(s))
    parts += _outcomes(data)
    parts += ["<h2>Latency distributions</h2>", _png(plots.distributions(s))]
    if data.steps and len(data.steps["t_s"]):
        parts += ["<h2>Throughput</h2>", _png(plots.throughput(data.steps, s))]
        decodes = not tables.prefill_only(s)
        parts += ["<h2>Batch and KV cache</h2>", _png(plots.occupancy(data.steps, decodes))]
        parts += ["<h2>Roofline</h2>", _png(plots.roofline(data.steps, s))]
    else:
        parts.append('<p class="note">No step timeline here: no timeline to plot.</p>')
    parts += ["<h2>Rows over time</h2>", _figure(charts.rows_over_time(s), "No rows timed.")]
    parts += _job(data)
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        "<title>batchgen "
        f"report</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
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
