"""Where an engine run's time goes: torch.profiler over one benchmark workload, in process.

    python scripts/profile_engine.py --workload mixed          # the 55M Llama, 192 rows, CPU
    python scripts/profile_engine.py --workload long-tail --rows 96 --top 25
    python scripts/profile_engine.py --prompt-logprobs --rows 384 --threads 1   # issue 40

The workload is scripts/bench.py's (same rows, EOS ignored). The model loads and one short
warm-up job runs before the profiler starts, so the figures are the steady engine. Printed:
the wall time of `generate`, the top operators by self CPU time with their share of the wall
time, and these costs grouped (matmuls, attention, KV gather and copies, sampling, the rest of
the ops); what the ops do not cover is the Python side (scheduler, packing, bookkeeping) and
threads waiting. Shares, not seconds, are what carries over from a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import bench_models  # noqa: E402

from batchgen.engine.sequence import SamplingParams  # noqa: E402
from batchgen.llm import LLM  # noqa: E402

GROUPS = {  # operator name fragments -> cost group (first match wins)
    "matmul": ("addmm", "aten::mm", "aten::bmm", "linear", "matmul"),
    "attention": ("scaled_dot_product", "flash_attention", "flex_attention", "_efficient"),
    "kv gather/copy": ("index_select", "gather", "index_put", "index_copy", "copy_", "cat"),
    "sampling": ("softmax", "argmax", "topk", "sort", "multinomial", "exponential"),
}


def group_of(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "other ops"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", choices=bench.WORKLOADS)
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--engine-args", default="", help="EngineConfig fields, k=v,k=v")
    p.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="score every prompt token (one new token a row), as --task prompt-logprobs does",
    )
    p.add_argument(
        "--shapes", action="store_true", help="also the matmuls by rows per call and weight shape"
    )
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = bench_models.cached(a.model)
    vocab = bench_models.SHAPES[a.model].config["vocab_size"]
    work = bench.make_workload(a.workload, a.rows, vocab)
    engine = dict(kv.split("=") for kv in a.engine_args.split(",") if kv)
    llm = LLM(model, device="cpu", dtype="float32", engine={k: int(v) for k, v in engine.items()})
    prompts = [llm.tokenizer(t)["input_ids"] for t in work["prompt"]]
    news = [1] * a.rows if a.prompt_logprobs else work["max_new_tokens"]
    plp = 0 if a.prompt_logprobs else None
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, prompt_logprobs=plp) for n in news]
    # the pool is sized at the first call: for the workload's rows, not the warm-up's
    llm.engine.reserve(max(len(p) + s.max_new_tokens for p, s in zip(prompts, params, strict=True)))
    llm.generate(prompts[:4], params[:4])  # warm-up: first calls, lazy imports
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=a.shapes) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    # self CPU time of every op, summed over threads (intra-op threads run inside an op's call)
    ops = sorted(
        ((e.key, e.self_cpu_time_total / 1e6, e.count) for e in events),
        key=lambda x: -x[1],
    )
    total_ops = sum(s for _, s, _ in ops)
    print(
        f"{a.workload}: {a.rows} rows, generate {wall:.2f} s wall, {torch.get_num_threads()} "
        f"threads; ops' self time {total_ops:.2f} s ({total_ops / wall:.0%} of wall)"
    )
    print("\n| operator | self s | share of wall | calls |\n|---|---|---|---|")
    for name, s, n in ops[: a.top]:
        print(f"| `{name}` | {s:.2f} | {s / wall:.1%} | {n} |")
    groups: dict[str, float] = defaultdict(float)
    for name, s, _ in ops:
        groups[group_of(name)] += s
    print("\n| cost | s | share of wall |\n|---|---|---|")
    for g, s in sorted(groups.items(), key=lambda x: -x[1]):
        print(f"| {g} | {s:.2f} | {s / wall:.1%} |")
    rest = wall - total_ops
    print(f"| Python and waiting (wall - ops) | {rest:.2f} | {rest / wall:.1%} |")
    if a.shapes:
        print_matmul_shapes(prof, wall)


ROW_BUCKETS = (16, 64, 512, 1 << 62)


def print_matmul_shapes(prof: torch.profiler.profile, wall: float) -> None:
    """Matmul time and rate by rows per call (bucketed) and weight shape: aten::mm (x, W^T)
    and the packed layers' mkldnn::_linear_pointwise (x, W)."""
    cells: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for e in prof.key_averages(group_by_input_shape=True):
        packed = e.key == "mkldnn::_linear_pointwise"
        if e.key != "aten::mm" and not packed:
            continue
        if len(e.input_shapes) < 2 or len(e.input_shapes[0]) != 2:
            continue
        (m, k), w = e.input_shapes[0], e.input_shapes[1]
        n = w[0] if packed else w[1]
        bucket = next(b for b in ROW_BUCKETS if m <= b)
        cell = cells[(bucket, f"{k}x{n}")]
        cell[0] += e.self_cpu_time_total / 1e6
        cell[1] += 2.0 * m * k * n * e.count
        cell[2] += e.count
    print("\n| rows per call | weight (in x out) | s | share of wall | GFLOP/s | calls |")
    print("|---|---|---|---|---|---|")
    for (bucket, shape), (s, flops, n) in sorted(cells.items(), key=lambda x: -x[1][0]):
        rows = f"<= {bucket}" if bucket < ROW_BUCKETS[-1] else f"> {ROW_BUCKETS[-2]}"
        print(f"| {rows} | {shape} | {s:.2f} | {s / wall:.1%} | {flops / s / 1e9:.0f} | {n} |")


if __name__ == "__main__":
    main()
