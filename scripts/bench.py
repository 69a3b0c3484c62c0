"""batchgen against the best transformers baseline, whole processes as a user runs them.

    python scripts/bench.py --workload mixed                      # CPU, the engine issue's job
    python scripts/bench.py --workload labeling,long-tail --pairs 2
    python scripts/bench.py --model qwen-0.5b --device cuda --dtype bfloat16   # on a GPU
    python scripts/bench.py --sweep-max-num-seqs 1,4,16,64,256   # latency against throughput

For each workload (a Parquet file of `id`, `prompt`, `max_new_tokens`; EOS ignored, so every
engine does the same work):

1. every transformers baseline of scripts/hf_baseline.py (`generate` in input order,
   `generate` on rows sorted by length, the continuous batching manager) runs once at each
   batch size of --baselines (default 8, 16 and 32 for each), and the fastest is the baseline;
2. then `batchgen run` and that baseline alternate, A B A B, --pairs times: the machine is
   shared, so the headline is the ratio of the medians, with each pair's ratio beside it.

Every run is a fresh process (`batchgen run` via its CLI; the baseline via its script),
timed from start to exit, peak RSS from wait4. Outputs are compared token for token with
batchgen's (greedy). batchgen's own `_stats.json` gives the per-phase times and the
compute shares; the floor is the job's matmul FLOPs at this machine's measured matmul rate.

With --sweep-max-num-seqs, no baseline runs: `batchgen run` runs once per value of
--max-num-seqs, and the sweep prints output tokens/s against p50/p99 TPOT and TTFT (from each
run's _stats.json) and saves the curve as a PNG (--sweep-png, default WORKDIR/sweep-NAME.png):
the latency/throughput trade-off of the batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_models  # noqa: E402

WORKLOADS = ("mixed", "labeling", "long-tail")
HF_MODES = ("input", "sorted", "cb")


def _words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"t{rng.randrange(2, vocab)}" for _ in range(n))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(0.0, sigma) * median)))


def make_workload(name: str, n: int, vocab: int, seed: int = 0) -> dict[str, list]:
    """One word = one token with bench_models' word tokenizer."""
    rng = random.Random(seed)
    prompts, news = [], []
    if name == "mixed":  # 8-400 words (median ~50), 4-128 new tokens (median ~27)
        for _ in range(n):
            prompts.append(_words(rng, _lognormal(rng, 50, 0.9, 8, 400), vocab))
            news.append(_lognormal(rng, 27, 0.8, 4, 128))
    elif name == "labeling":  # a ~500-token shared instruction + a short row, 1-4 new tokens
        instruction = _words(rng, 500, vocab)
        for _ in range(n):
            prompts.append(f"{instruction} {_words(rng, rng.randint(10, 60), vocab)}")
            news.append(rng.randint(1, 4))
    elif name == "long-tail":  # most rows short; 1 in 20 a 1000-token prompt, 256 new tokens
        for _ in range(n):
            if rng.random() < 0.05:
                prompts.append(_words(rng, 1000, vocab))
                news.append(256)
            else:
                prompts.append(_words(rng, rng.randint(10, 80), vocab))
                news.append(rng.randint(8, 64))
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return {"id": list(range(n)), "prompt": prompts, "max_new_tokens": news}


# Linux's ru_maxrss of a child counts the memory of the process it was forked from, so
# each run is started by this small launcher, whose own footprint is a bare interpreter.
_LAUNCHER = """import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)"""


def timed(cmd: list[str], log: Path) -> dict:
    """Run cmd to completion: wall seconds and the process's peak RSS."""
    rss = log.with_suffix(".rss")
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.call(
            [sys.executable, "-c", _LAUNCHER, str(rss), *cmd],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; log: {log}\n{log.read_text()[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": int(rss.read_text()) * 1024}


def batchgen_cmd(a, model: Path, data: Path, out: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "batchgen.cli",
        "run",
        str(data),
        "-o",
        str(out),
        "--model",
        str(model),
        "--id-column",
        "id",
        "--ignore-eos",
        "--max-new-tokens",
        "256",
        "--with-token-ids",
        "--quiet",
        "--overwrite",
        "--device",
        a.device,
        "--dtype",
        a.dtype,
        *a.batchgen_args.split(),
    ]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def hf_cmd(a, model: Path, data: Path, out: Path, mode: str, batch: int) -> list[str]:
    cmd = [
        sys.executable,
        str(HERE / "hf_baseline.py"),
        str(model),
        str(data),
        str(out),
        "--mode",
        mode,
        "--batch-size",
        str(batch),
        "--dtype",
        a.dtype,
        "--device",
        a.device,
    ]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def token_ids(path: Path) -> dict[int, list[int]]:
    t = pq.read_table(path, columns=["id", "token_ids"])
    return dict(zip(t.column("id").to_pylist(), t.column("token_ids").to_pylist(), strict=True))


def floor_seconds(model: Path, work: dict[str, list], matmul_flops: float) -> float:
    """The job's matmul FLOPs (every prompt and output token through the blocks, the LM
    head for output tokens only, attention over each token's context) at the measured rate."""
    import roofline

    from batchgen.model.hf_config import config_from_hf, read_hf_config

    cfg = config_from_hf(read_hf_config(model))
    cost = roofline.ModelCost.from_config(cfg, 4)
    flops = 0.0
    for p, n in zip(work["prompt"], work["max_new_tokens"], strict=True):
        L = len(p.split())
        ctx = L * (L + 1) / 2 + sum(L + i for i in range(n))  # keys each query attends to
        flops += 2 * cost.layer_params * (L + n) + 2 * cost.head_params * n
        flops += 4 * cost.attn_width * ctx
    return flops / matmul_flops


def bench_workload(a, name: str, model: Path, root: Path, matmul_flops: float) -> dict:
    vocab = bench_models.SHAPES[a.model].config["vocab_size"]
    work = make_workload(name, a.rows, vocab)
    data = root / f"{name}.parquet"
    pq.write_table(pa.table(work), data)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    runs: list[dict] = []

    def run_batchgen(k: int) -> dict:
        out = root / f"{name}-batchgen"
        r = timed(batchgen_cmd(a, model, data, out), logs / f"{name}-batchgen-{k}.log")
        r.update(engine="batchgen", stats=json.loads((out / "_stats.json").read_text()))
        r["ids"] = token_ids(out)
        runs.append(r)
        return r

    def run_hf(mode: str, b: int, k: int) -> dict:
        out = root / f"{name}-hf-{mode}-{b}.parquet"
        r = timed(hf_cmd(a, model, data, out, mode, b), logs / f"{name}-hf-{mode}-{b}-{k}.log")
        r.update(engine=f"hf-{mode}", batch_size=b, ids=token_ids(out))
        runs.append(r)
        return r

    explore = [run_hf(m, int(b), 0) for m, b in (x.split(":") for x in a.baselines.split(","))]
    best = min(explore, key=lambda r: r["wall_s"])
    bg, hf = [], [best]
    for k in range(a.pairs):
        bg.append(run_batchgen(k))
        if k:  # the exploration run of the best baseline is the first B
            hf.append(run_hf(best["engine"].removeprefix("hf-"), best["batch_size"], k))
    ref = bg[0]["ids"]
    for r in runs:
        r["rows_differing"] = sum(r["ids"].get(i) != ids for i, ids in ref.items())
        del r["ids"]
    bg_med = statistics.median(r["wall_s"] for r in bg)
    hf_med = statistics.median(r["wall_s"] for r in hf)
    floor = floor_seconds(model, work, matmul_flops)
    return {
        "workload": name,
        "rows": a.rows,
        "prompt_tokens": sum(len(p.split()) for p in work["prompt"]),
        "output_tokens": sum(work["max_new_tokens"]),
        "baseline": f"{best['engine']} batch {best['batch_size']}",
        "batchgen_median_s": bg_med,
        "baseline_median_s": hf_med,
        "speedup": hf_med / bg_med,
        "pair_speedups": [h["wall_s"] / b["wall_s"] for b, h in zip(bg, hf, strict=False)],
        "floor_s": floor,
        "roofline_share": floor / bg_med,
        "runs": runs,
    }


def sweep_workload(a, name: str, model: Path, root: Path) -> dict:
    """One `batchgen run` per --max-num-seqs value: throughput against TPOT and TTFT."""
    vocab = bench_models.SHAPES[a.model].config["vocab_size"]
    data = root / f"{name}.parquet"
    pq.write_table(pa.table(make_workload(name, a.rows, vocab)), data)
    (root / "logs").mkdir(exist_ok=True)
    points = []
    for v in (int(x) for x in a.sweep_max_num_seqs.split(",")):
        out = root / f"{name}-seqs-{v}"
        cmd = [*batchgen_cmd(a, model, data, out), "--max-num-seqs", str(v)]
        r = timed(cmd, root / "logs" / f"{name}-seqs-{v}.log")
        s = json.loads((out / "_stats.json").read_text())
        point = {"max_num_seqs": v, "wall_s": r["wall_s"], "out_tok_s": s["output_tokens_per_s"]}
        for key in ("ttft_s", "tpot_s"):
            point.update({f"{key[:4]}_{q}_s": s[key][q] for q in ("p50", "p99")})
        points.append(point)
    png = a.sweep_png or root / f"sweep-{name}.png"
    plot_sweep(points, png, f"{a.model}, {name}, {a.rows} rows, {a.device} {a.dtype}")
    return {"workload": name, "rows": a.rows, "sweep": points, "png": str(png)}


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
        lines += [
            "",
            f"**batchgen {w['batchgen_median_s']:.1f} s vs best baseline ({w['baseline']}) "
            f"{w['baseline_median_s']:.1f} s: {w['speedup']:.2f}x** (medians; pairs "
            + ", ".join(f"{x:.2f}x" for x in w["pair_speedups"])
            + f"). Floor {w['floor_s']:.1f} s: batchgen at {w['roofline_share']:.0%} of it.",
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--pairs", type=int, default=2, help="batchgen/baseline pairs (A B A B)")
    p.add_argument(
        "--baselines",
        default=",".join(f"{m}:{b}" for m in HF_MODES for b in (8, 16, 32)),
        help="transformers runs to try, MODE:BATCH comma-separated; the fastest is the baseline",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batchgen-args", default="", help="extra `batchgen run` flags")
    p.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench")
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    p.add_argument("--markdown", type=Path, default=None, help="append the markdown here")
    p.add_argument(
        "--sweep-max-num-seqs",
        default=None,
        help="e.g. 1,4,16,64,256: one batchgen run per value (no baselines); throughput "
        "against p50/p99 TPOT and TTFT, printed and plotted",
    )
    p.add_argument("--sweep-png", type=Path, default=None, help="the sweep's plot (one workload)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import roofline
    import torch

    a.workdir.mkdir(parents=True, exist_ok=True)
    model = bench_models.cached(a.model, a.dtype, a.device)
    sweeping = a.sweep_max_num_seqs is not None
    ceilings = None if sweeping else roofline.measure(a.device, getattr(torch, a.dtype))
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, {a.device} {a.dtype}",
        "command": "python scripts/bench.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": a.model,
        "matmul_flops": ceilings.matmul_flops if ceilings else None,
        "workloads": [],
    }
    for name in a.workload.split(","):
        if sweeping:
            report["workloads"].append(sweep_workload(a, name, model, a.workdir))
        else:
            flops = ceilings.matmul_flops
            report["workloads"].append(bench_workload(a, name, model, a.workdir, flops))
        if a.out:
            a.out.write_text(json.dumps(report, indent=1))
    text = sweep_markdown(report) if sweeping else markdown(report)
    print(text)
    if a.markdown:
        with a.markdown.open("a") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
