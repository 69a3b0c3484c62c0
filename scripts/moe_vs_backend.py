"""A native decoder (the MoE of model/families/moe.py, Gemma's of model/families/gemma.py) against
the transformers backend on the same checkpoint, whole `batchgen run` processes as a user runs them.

    python scripts/moe_vs_backend.py                 # CPU float32, qwen3-moe-60m, 2 pairs
    python scripts/moe_vs_backend.py --model gemma3-30m
    python scripts/moe_vs_backend.py --device cuda --dtype bfloat16 --rows 512

`--model-impl native` and `--model-impl transformers` alternate, A B A B, --pairs times (the
machine is shared: medians, each pair's ratio beside them). Per run: wall seconds, the
engine's seconds (prefill_s + decode_s from `.batchgen/stats.json`), its steps and the mean
step time; token ids are compared with the first native run's (greedy float32: they must be
equal, as tests/test_moe.py and tests/test_gemma.py check on the tiny models).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from batchgen.data.layout import STATS_FILE

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import bench_models  # noqa: E402

IMPLS = ("native", "transformers")


def run(a, model: Path, data: Path, root: Path, impl: str, k: int) -> dict:
    out = root / impl
    a.batchgen_args = f"{a.extra} --model-impl {impl}"
    r = bench.timed(bench.batchgen_cmd(a, model, data, out), root / "logs" / f"{impl}-{k}.log")
    s = json.loads((out / STATS_FILE).read_text())
    engine_s = s["prefill_s"] + s["decode_s"]
    r.update(impl=impl, ids=bench.token_ids(out), engine_s=engine_s, steps=s["steps"])
    r["step_ms"] = 1e3 * engine_s / s["steps"]
    return r


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", choices=bench.WORKLOADS)
    p.add_argument("--model", default="qwen3-moe-60m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--extra", default="--no-compile", help="more `batchgen run` flags")
    p.add_argument("--workdir", type=Path, default=bench.ROOT / "out" / "bench-moe")
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    a = p.parse_args(argv)
    root = a.workdir
    (root / "logs").mkdir(parents=True, exist_ok=True)
    model = bench_models.cached(a.model, a.dtype, a.device)
    data, _ = bench.write_workload(a.workload, a.rows, a.model, root)

    runs = [run(a, model, data, root, impl, k) for k in range(a.pairs) for impl in IMPLS]
    bench.mark_differing(runs, runs[0]["ids"])
    by = {impl: [r for r in runs if r["impl"] == impl] for impl in IMPLS}
    med = {impl: statistics.median(r["wall_s"] for r in rs) for impl, rs in by.items()}
    step = {impl: statistics.median(r["step_ms"] for r in rs) for impl, rs in by.items()}
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, {a.device} {a.dtype}",
        "command": "python " + " ".join(["scripts/moe_vs_backend.py", *(argv or sys.argv[1:])]),
        "model": a.model,
        "workload": a.workload,
        "rows": a.rows,
        "median_wall_s": med,
        "median_step_ms": step,
        "pair_ratios": [
            b["wall_s"] / n["wall_s"] for n, b in zip(*by.values(), strict=True)
        ],  # backend / native
        "runs": runs,
    }
    print(markdown(report))
    if a.out:
        a.out.write_text(json.dumps(report, indent=2))
    return report


def markdown(r: dict) -> str:
    lines = [
        f"## {r['model']} native vs backend {r['date']} · {r['machine']}",
        "",
        f"`{r['command']}` ({r['model']}, {r['workload']}, {r['rows']} rows)",
        "",
        "| run | wall s | engine s | steps | ms/step | peak RSS MiB | rows ≠ native |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        lines.append(
            f"| {x['impl']} | {x['wall_s']:.1f} | {x['engine_s']:.1f} | {x['steps']} | "
            f"{x['step_ms']:.1f} | {x['peak_rss_bytes'] / 2**20:.0f} | {x['rows_differing']} |"
        )
    w, s = r["median_wall_s"], r["median_step_ms"]
    ratios = ", ".join(f"{x:.2f}x" for x in r["pair_ratios"])
    lines += [
        "",
        f"Medians: wall {w['native']:.1f} s native, {w['transformers']:.1f} s backend "
        f"({w['transformers'] / w['native']:.2f}x); step {s['native']:.1f} ms native, "
        f"{s['transformers']:.1f} ms backend ({s['transformers'] / s['native']:.2f}x). "
        f"Backend/native wall per pair: {ratios}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
