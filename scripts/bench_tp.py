"""Tensor parallelism against one process, whole `batchgen run` processes as a user runs them.

    python scripts/bench_tp.py                      # CPU: TP=2 over gloo vs TP=1, mixed, 2 pairs
    python scripts/bench_tp.py --device cuda --dtype bfloat16 --model qwen-0.5b   # 2+ GPUs

TP=1 and TP=N alternate, A B A B, --pairs times (the machine is shared: medians, each pair's
ratio beside them). Per run: wall seconds, the largest process's peak RSS (rank 0 or a
follower: each holds its own slices), and from `.batchgen/stats.json` the weight bytes per rank, the
KV pool per rank and the share of step time spent in collectives. Token ids are compared
with the TP=1 run (greedy; an all-reduce reorders sums, so a near-tie may part).

On 2 CPU cores TP=2 cannot be faster: each rank gets one core for half the matmuls, and every
layer adds two all-reduces over loopback TCP plus one pipe message per step. The figures say
what the split costs; tensor parallelism is for models that do not fit one GPU.
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


def run(a, model: Path, data: Path, root: Path, tp: int, k: int) -> dict:
    out = root / f"tp{tp}"
    a.batchgen_args = f"{a.extra} --tensor-parallel-size {tp}"
    cmd = bench.batchgen_cmd(a, model, data, out)
    r = bench.timed(cmd, root / "logs" / f"tp{tp}-{k}.log")
    s = json.loads((out / STATS_FILE).read_text())
    r.update(
        tp=tp,
        ids=bench.token_ids(out),
        engine_s=s["prefill_s"] + s["decode_s"],
        collective_share=s.get("collective_share"),
        weights_bytes_per_rank=s["weights_bytes_per_rank"],
        kv_cache_bytes_per_rank=s.get("kv_cache_bytes"),
        steps=s["steps"],
    )
    return r


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", choices=bench.WORKLOADS)
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="threads per rank")
    p.add_argument("--extra", default="", help="more `batchgen run` flags")
    p.add_argument("--workdir", type=Path, default=bench.ROOT / "out" / "bench-tp")
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    a = p.parse_args(argv)
    root = a.workdir
    (root / "logs").mkdir(parents=True, exist_ok=True)
    model = bench_models.cached(a.model, a.dtype, a.device)
    data, _ = bench.write_workload(a.workload, a.rows, a.model, root)

    runs = [run(a, model, data, root, tp, k) for k in range(a.pairs) for tp in (1, a.tp)]
    bench.mark_differing(runs, runs[0]["ids"])
    one = [r for r in runs if r["tp"] == 1]
    split = [r for r in runs if r["tp"] == a.tp]
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in ((1, one), (a.tp, split))}
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, {a.device} {a.dtype}",
        "command": "python " + " ".join(["scripts/bench_tp.py", *(argv or sys.argv[1:])]),
        "workload": a.workload,
        "rows": a.rows,
        "median_s": {str(k): v for k, v in med.items()},
        "slowdown": med[a.tp] / med[1],
        "pair_ratios": [b["wall_s"] / o["wall_s"] for o, b in zip(one, split, strict=True)],
        "runs": runs,
    }
    print(markdown(report))
    if a.out:
        a.out.write_text(json.dumps(report, indent=2))
    return report


def markdown(r: dict) -> str:
    mib = 2**20
    lines = [
        f"## TP {r['date']} · {r['machine']}",
        "",
        f"`{r['command']}` ({r['workload']}, {r['rows']} rows)",
        "",
        "| run | wall s | engine s | collectives | weights/rank MiB | KV/rank MiB | peak RSS MiB "
        "| rows ≠ TP=1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        share = x["collective_share"]
        lines.append(
            f"| TP={x['tp']} | {x['wall_s']:.1f} | {x['engine_s']:.1f} | "
            f"{'-' if share is None else f'{share:.0%}'} | "
            f"{x['weights_bytes_per_rank'] / mib:.0f} | "
            f"{(x['kv_cache_bytes_per_rank'] or 0) / mib:.0f}"
            f" | {x['peak_rss_bytes'] / mib:.0f} | {x['rows_differing']} |"
        )
    ratios = ", ".join(f"{x:.2f}x" for x in r["pair_ratios"])
    lines += ["", f"TP/TP=1 wall time, medians: **{r['slowdown']:.2f}x** (pairs {ratios})."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
