"""`batchgen plan`: the bucketing of a whole input, without loading the weights."""

from __future__ import annotations

from collections import Counter
from typing import Any

from batchgen.config import RunConfig
from batchgen.planner import plan_batches
from batchgen.run import open_job


def make_plan(cfg: RunConfig) -> dict[str, Any]:
    job = open_job(cfg)
    hist: Counter = Counter()
    batches: Counter = Counter()  # (bucket, batch size, new-token bucket) -> count
    rows = errors = real = computed = max_kv = 0
    for _, window in job.prep.windows(done=set()):
        rows += len(window.rows)
        errors += len(window.errors)
        reqs = window.requests
        plan = plan_batches(
            [r.prompt_len for r in reqs], [r.params.max_new_tokens for r in reqs], job.buckets
        )
        hist.update(plan.histogram)
        batches.update((b.prompt_len, b.batch_size, b.max_new) for b in plan.batches)
        real += plan.real_prompt_tokens
        computed += plan.computed_prompt_tokens
        max_kv = max(max_kv, plan.max_kv_tokens)
    kv_bytes = job.model_cfg.kv_bytes_per_token(job.dtype.itemsize)
    return {
        "input": cfg.input,
        "model": str(job.model_dir),
        "rows": rows,
        "rows_error": errors,
        "prompt_tokens": real,
        "padding_efficiency": real / computed if computed else 1.0,
        "length_histogram": {str(k): v for k, v in sorted(hist.items())},
        "batches": [
            {"bucket": L, "batch_size": b, "max_new": m, "count": n}
            for (L, b, m), n in sorted(batches.items())
        ],
        "compiled_shapes": len(batches),
        "kv_cache_tokens_max_batch": max_kv,
        "kv_cache_bytes_max_batch": max_kv * kv_bytes,
        "kv_cache_capacity_tokens": job.buckets.kv_capacity_tokens,
        "dtype": str(job.dtype).removeprefix("torch."),
    }


def format_plan(p: dict[str, Any]) -> str:
    lines = [
        f"input   {p['input']}",
        f"model   {p['model']} ({p['dtype']})",
        f"rows    {p['rows']} ({p['rows_error']} would get an error record)",
        "",
        "prompt length histogram (bucket edge: rows)",
    ]
    peak = max(p["length_histogram"].values(), default=1)
    for edge, n in p["length_histogram"].items():
        lines.append(f"  <= {edge:>6}  {n:>8}  {'#' * max(1, round(40 * n / peak))}")
    lines += ["", "batches (bucket x batch size, new-token bucket: count)"]
    for b in p["batches"]:
        lines.append(
            f"  {b['bucket']:>6} x {b['batch_size']:<4} new {b['max_new']:<5} {b['count']:>6}"
        )
    lines += [
        "",
        f"padding efficiency   {p['padding_efficiency']:.1%} (real prompt tokens / computed)",
        f"compiled shapes      {p['compiled_shapes']} prefill (+ as many decode)",
        f"KV cache, largest batch  {p['kv_cache_tokens_max_batch']} tokens = "
        f"{p['kv_cache_bytes_max_batch'] / 2**20:.1f} MiB (capacity {p['kv_cache_capacity_tokens']} tokens)",
    ]
    return "\n".join(lines)
