"""Eager vs compiled on one model, in one run: compile time and warm tokens/s.

    python scripts/bench_compile.py                   # the embedded demo model, its sample prompts
    python scripts/bench_compile.py --model DIR --threads 1 --new-tokens 64

Each mode generates for the same prompts twice with EOS ignored: the first pass compiles
(the time is reported as compile + warm-up), the second is the steady state. Compiled, the
engine runs every step, prefill chunks and decodes, through one graph over a symbolic token
count (engine/compiled_forward.py), its compile cache the user's (set XDG_CACHE_HOME for a
fresh one: a second run then reports the warm compile). The prefix cache is off, so the two
passes do the same work. Times come from the engine's step reports: decode is the
decode-only steps, compile the warm-up's. Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import pyarrow.parquet as pq
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import Completion, Request, SamplingParams
from batchgen.job.model_spec import DEFAULT_MODEL, resolve_device
from batchgen.llm import LLM

SAMPLES = DEFAULT_MODEL.parent / "samples" / "prompts.parquet"


def run_pass(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One generate call over all prompts, with its step reports summed."""
    requests = [Request(i, ids, params) for i, ids in enumerate(prompts)]
    out: list[Completion | None] = [None] * len(requests)
    decode_s = compile_s = 0.0
    decode_steps = decode_rows = 0
    t0 = time.perf_counter()
    for r in llm.engine.generate(requests):
        for c in r.finished:
            out[c.index] = c
        compile_s += r.compile_seconds
        if not r.prefill and r.decode_rows:
            decode_s += r.seconds
            decode_steps += 1
            decode_rows += r.decode_rows
    errors = [c.error for c in out if c is None or c.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed, e.g. {errors[0]}")
    return {
        "wall_s": time.perf_counter() - t0,
        "tokens": sum(len(c.token_ids) for c in out),
        "decode_s": decode_s,
        "decode_steps": decode_steps,
        "decode_rows": decode_rows,
        "compile_s": compile_s,
        "token_ids": [c.token_ids for c in out],
    }


def measure(args, prompts: list[str], params: SamplingParams, mode: str) -> dict:
    engine = EngineConfig.for_device(
        resolve_device(args.device).type, max_num_seqs=args.max_num_seqs, prefix_caching=False
    )
    llm = LLM(args.model, device=args.device, compile=mode == "compiled", engine=engine)
    ids = [llm.tokenizer(p)["input_ids"] for p in prompts]
    cold, warm = run_pass(llm, ids, params), run_pass(llm, ids, params)
    return {
        "mode": mode,
        "compile_s": cold["compile_s"] + warm["compile_s"],
        "graphs": llm.runner.graph.graphs if llm.runner.graph is not None else 0,
        "cold_wall_s": cold["wall_s"],
        "warm_wall_s": warm["wall_s"],
        "warm_compile_s": warm["compile_s"],  # > 0: the warm pass met a new shape
        "warm_out_tok_s": warm["tokens"] / warm["wall_s"],
        "warm_decode_tok_s": warm["decode_rows"] / warm["decode_s"] if warm["decode_s"] else 0.0,
        "warm_ms_per_step": 1000 * warm["decode_s"] / max(1, warm["decode_steps"]),
        "token_ids": warm["token_ids"],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompts", default=str(SAMPLES), help="Parquet file with a prompt column")
    p.add_argument("--n-prompts", type=int, default=None, help="the first N prompts only")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=None, help="(default: the engine's)")
    p.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = pq.read_table(args.prompts)["prompt"].to_pylist()[: args.n_prompts]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    modes = args.modes.split(",")
    if not set(modes) <= {"eager", "compiled"}:
        p.error(f"--modes: eager and/or compiled, got {args.modes!r}")
    results = [measure(args, prompts, params, m) for m in modes]
    same = all(r["token_ids"] == results[0]["token_ids"] for r in results)
    print(
        f"{len(prompts)} prompts x {args.new_tokens} new tokens, {torch.get_num_threads()} "
        "threads; "
        f"identical tokens across modes: {same}\n"
    )
    print(
        "| mode | graphs | compile + warm-up s | cold pass s | warm pass s | warm out tok/s | warm "
        "decode tok/s | ms/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['mode']} | {r['graphs']} | {r['compile_s']:.1f} | {r['cold_wall_s']:.2f} | "
            f"{r['warm_wall_s']:.2f} | {r['warm_out_tok_s']:.0f} | {r['warm_decode_tok_s']:.0f} | "
            f"{r['warm_ms_per_step']:.2f} |"
        )
    for r in results:
        r.pop("token_ids")
    report = {"identical_tokens": same, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
