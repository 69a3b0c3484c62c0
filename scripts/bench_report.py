"""scripts/bench.py's output: the markdown of a report and the sweep's plot, apart from the
code that runs and times the engines."""

from __future__ import annotations

from pathlib import Path


def plot_sweep(points: list[dict], path: Path, title: str) -> None:
    """TPOT and TTFT (p50 solid, p99 dashed) against output tokens/s, each point labelled
    with its max_num_seqs."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6), dpi=80, layout="constrained")
    fig.suptitle(title)
    x = [p["out_tok_s"] for p in points]
    for i, key in enumerate(("tpot", "ttft")):
        ax = fig.add_subplot(1, 2, i + 1)
        for q, style in (("p50", "-o"), ("p99", "--o")):
            ax.plot(x, [p[f"{key}_{q}_s"] * 1e3 for p in points], style, label=q)
        for p in points:
            ax.annotate(str(p["max_num_seqs"]), (p["out_tok_s"], p[f"{key}_p50_s"] * 1e3))
        ax.set(xlabel="output tokens/s", ylabel=f"{key.upper()} (ms)", yscale="log")
        ax.set_title(f"{key.upper()} against throughput (labels: --max-num-seqs)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.savefig(path)


def sweep_markdown(report: dict) -> str:
    lines = [f"## {report['date']} · {report['machine']}", "", f"`{report['command']}`", ""]
    for w in report["workloads"]:
        lines += [
            f"### {w['workload']}: {w['rows']} rows ({w['png']})",
            "",
            "| max_num_seqs | wall s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
            "|---|---|---|---|---|",
        ]
        for p in w["sweep"]:
            lines.append(
                f"| {p['max_num_seqs']} | {p['wall_s']:.1f} | {p['out_tok_s']:.1f} "
                f"| {p['ttft_p50_s'] * 1e3:.0f} / {p['ttft_p99_s'] * 1e3:.0f} "
                f"| {p['tpot_p50_s'] * 1e3:.1f} / {p['tpot_p99_s'] * 1e3:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    lines = [f"## {report['date']} · {report['machine']}", "", f"`{report['command']}`", ""]
    for w in report["workloads"]:
        s = next(r for r in w["runs"] if r["engine"] == "batchgen")["stats"]
        lines += [
            f"### {w['workload']}: {w['rows']} rows, {w['prompt_tokens']} prompt tokens, "
            f"{w['output_tokens']} output tokens",
            "",
            "| run | wall s | peak RSS MiB | rows ≠ batchgen |",
            "|---|---|---|---|",
        ]
        for r in w["runs"]:
            label = r["engine"] + (f" batch {r['batch_size']}" if "batch_size" in r else "")
            lines.append(
                f"| {label} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} "
                f"| {r['rows_differing']} |"
            )
        lines.append("")
        for v in w["peers"]:  # one headline per engine: its fastest baseline, paired
            lines.append(
                f"**batchgen {w['batchgen_median_s']:.1f} s vs best {v['engine']} baseline "
                f"({v['baseline']}) {v['baseline_median_s']:.1f} s: {v['speedup']:.2f}x** "
                "(medians; pairs " + ", ".join(f"{x:.2f}x" for x in v["pair_speedups"]) + ")."
            )
        lines += [
            "",
            f"Floor {w['floor_s']:.1f} s: batchgen at {w['roofline_share']:.0%} of it.",
            "",
            f"batchgen phases (first run): load {s['load_s']:.1f} s, prefill steps "
            f"{s['prefill_s']:.1f} s, decode steps {s['decode_s']:.1f} s, compile "
            f"{s['compile_s']:.1f} s; prompt tokens computed / real {s['prompt_compute_ratio']:.2f}"
            f" (prefix cache hit rate {s.get('prefix_cache_hit_rate', 0):.0%}); decode rows live "
            f"{s['decode_live_share']:.2f}; {s['steps']} steps, {s['preemptions']} preemptions; "
            f"KV pool {s.get('kv_cache_bytes', 0) / 2**20:.0f} MiB.",
            "",
        ]
    return "\n".join(lines)
