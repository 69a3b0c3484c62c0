"""Eager vs compiled on one model, in one run: compile time and warm tokens/s.

    python scripts/bench_compile.py                   # the embedded demo model, its sample prompts
    python scripts/bench_compile.py --model DIR --threads 1 --new-tokens 64

Each mode generates for the same prompts twice with EOS ignored: the first pass compiles
(the time is reported as compile + warm-up), the second is the steady state. Prints a
markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import pyarrow.parquet as pq
import torch

from batchgen.engine.sequence import SamplingParams
from batchgen.llm import DEFAULT_MODEL, LLM
from batchgen.planner import BucketConfig

SAMPLES = DEFAULT_MODEL.parent / "samples" / "prompts.parquet"


def measure(model: str, prompts: list[str], params: SamplingParams, mode: str) -> dict:
    llm = LLM(
        model,
        device="cpu",
        compile=mode == "compiled",
        buckets=BucketConfig(max_prompt_len=256),
    )
    passes = []
    for _ in range(2):
        stats = llm.runner.stats
        decode0, steps0, t0 = stats.decode_s, stats.decode_steps, time.perf_counter()
        out = llm.generate(prompts, params)
        passes.append(
            {
                "wall_s": time.perf_counter() - t0,
                "tokens": sum(len(o.token_ids) for o in out),
                "decode_s": stats.decode_s - decode0,
                "decode_steps": stats.decode_steps - steps0,
                "token_ids": [o.token_ids for o in out],
            }
        )
    cold, warm = passes
    return {
        "mode": mode,
        "compile_s": llm.runner.stats.compile_s,
        "graphs": len(llm.runner.stats.shapes),
        "cold_wall_s": cold["wall_s"],
        "warm_wall_s": warm["wall_s"],
        "warm_out_tok_s": warm["tokens"] / warm["wall_s"],
        "warm_decode_tok_s": warm["tokens"] / warm["decode_s"] if warm["decode_s"] else 0.0,
        "warm_ms_per_step": 1000 * warm["decode_s"] / max(1, warm["decode_steps"]),
        "token_ids": warm["token_ids"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompts", default=str(SAMPLES), help="Parquet file with a prompt column")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = pq.read_table(args.prompts)["prompt"].to_pylist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    modes = ["eager", "compiled"]
    results = [measure(args.model, prompts, params, m) for m in modes]
    same = all(r["token_ids"] == results[0]["token_ids"] for r in results)
    print(f"{len(prompts)} prompts x {args.new_tokens} new tokens, {torch.get_num_threads()} threads; "
          f"identical tokens across modes: {same}\n")  # fmt: skip
    print(
        "| mode | graphs | compile + warm-up s | cold pass s | warm pass s | warm out tok/s | warm decode tok/s | ms/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['mode']} | {r['graphs']} | {r['compile_s']:.1f} | {r['cold_wall_s']:.2f} | "
              f"{r['warm_wall_s']:.2f} | {r['warm_out_tok_s']:.0f} | {r['warm_decode_tok_s']:.0f} | "
              f"{r['warm_ms_per_step']:.2f} |")  # fmt: skip
    if args.out:
        for r in results:
            r.pop("token_ids")
        with open(args.out, "w") as f:
            json.dump({"identical_tokens": same, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
