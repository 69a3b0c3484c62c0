"""Decode attention A/B in the real engine step: gather + SDPA against FlexAttention.

Every engine step of a bench.py workload runs twice in one process, once with each decode
attention (`ModelRunner.flex`), in alternating order (A B, then B A), and the two must give
the same tokens. Per-step wall times are paired, so the shared machine's load moves both.
The first step at each decode batch size is counted apart: for FlexAttention it compiles.

    python scripts/bench_decode_attention.py --workload mixed [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import bench_models  # noqa: E402
import torch  # noqa: E402

from batchgen.engine.model_runner import ModelRunner, next_pow2  # noqa: E402
from batchgen.engine.sequence import SamplingParams  # noqa: E402
from batchgen.llm import LLM  # noqa: E402

IMPLS = ("sdpa", "flex")


def paired_execute(log: list[dict]):
    execute = ModelRunner.execute
    seen: dict[str, set[int]] = {i: set() for i in IMPLS}

    def both(self, plan, bitmask=None):
        res = {}
        for impl in IMPLS if len(log) % 2 == 0 else IMPLS[::-1]:
            self.flex = impl == "flex"
            t0 = time.perf_counter()
            out, timing = execute(self, plan, bitmask)
            res[impl] = (out, time.perf_counter() - t0, timing)
        a, b = res["sdpa"][0], res["flex"][0]
        if [t for t, _ in a] != [t for t, _ in b]:
            raise AssertionError(f"step {len(log)}: tokens differ")
        n = len(plan.decodes)
        key = next_pow2(n) if n else 0
        first = n > 0 and any(key not in seen[i] for i in IMPLS)
        for i in IMPLS:
            seen[i].add(key)
        log.append(dict(decodes=n, prefills=len(plan.prefills), first=first,
                        sdpa=res["sdpa"][1], flex=res["flex"][1],
                        logprob_diff=max((abs(x[1] - y[1]) for x, y in zip(a, b, strict=True)), default=0.0)))  # fmt: skip
        return res["sdpa"][0], res["sdpa"][2]

    return both


def summary(log: list[dict]) -> dict:
    def part(rows):
        s, f = sum(r["sdpa"] for r in rows), sum(r["flex"] for r in rows)
        med = statistics.median(r["sdpa"] / r["flex"] for r in rows) if rows else None
        return dict(steps=len(rows), sdpa_s=s, flex_s=f, median_step_ratio=med)

    steady = [r for r in log if not r["first"]]
    by_batch = defaultdict(list)
    for r in steady:
        if r["decodes"] and not r["prefills"]:
            by_batch[next_pow2(r["decodes"])].append(r)
    return {
        "decode_only": part([r for r in steady if r["decodes"] and not r["prefills"]]),
        "decode_and_prefill": part([r for r in steady if r["decodes"] and r["prefills"]]),
        "prefill_only": part([r for r in steady if not r["decodes"]]),
        "first_call_per_batch_size": part([r for r in log if r["first"]]),
        "whole": part(log),
        "decode_only_by_batch": {
            b: dict(
                steps=len(rs),
                sdpa_ms=1e3 * statistics.median(r["sdpa"] for r in rs),
                flex_ms=1e3 * statistics.median(r["flex"] for r in rs),
                median_ratio=statistics.median(r["sdpa"] / r["flex"] for r in rs),
            )  # fmt: skip
            for b, rs in sorted(by_batch.items())
        },
        "max_logprob_diff": max(r["logprob_diff"] for r in log),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="mixed", choices=bench.WORKLOADS)
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--compile", action="store_true", help="the compiled decode step")
    p.add_argument("--out", default=None, help="JSON report")
    a = p.parse_args(argv)
    model = bench_models.cached(a.model)
    work = bench.make_workload(
        a.workload, a.rows, bench_models.SHAPES[a.model].config["vocab_size"]
    )
    llm = LLM(str(model), dtype="float32", device="cpu", compile=a.compile)
    log: list[dict] = []
    ModelRunner.execute = paired_execute(log)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in work["max_new_tokens"]]
    load0 = os.getloadavg()
    llm.generate(work["prompt"], params)
    report = dict(workload=a.workload, compile=a.compile, threads=torch.get_num_threads(),
                  load_before=load0, load_after=os.getloadavg(), **summary(log))  # fmt: skip
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(report, steps=log), indent=1))
    return report


if __name__ == "__main__":
    main()
