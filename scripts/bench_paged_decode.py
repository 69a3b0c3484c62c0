"""Decode attention of one layer: gather + SDPA against FlexAttention reading the paged pool in
place (model/attention/paged_flex.py), at a given shape. Time per call, and the bandwidth each
achieves on the bytes attention must read: every row's keys and values once (rows x ctx x kv heads x
head dim x 2 x bytes). The gather path moves three times that (read the pool, write the copy,
read the copy); in place moves it once.

The pool's blocks are handed out in a random order, as after a long run; every row holds
ctx / block_size of them. Both paths get the same queries; their outputs are compared. On CUDA
the flex call is compiled (its first call, the compile, is timed apart); the gather runs as the
eager ops (index_select, then SDPA's fused kernel).

    python scripts/bench_paged_decode.py --device cuda --dtype bfloat16 --rows 32,256 \\
        --ctx 1024 --out decode.json

--options sweeps the flex kernel's options (model/attention/paged_flex.py FLEX_OPTIONS, set through
BATCHGEN_FLEX_OPTIONS): a JSON list of option objects, each a row of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.paged_flex import (
    FLEX_OPTIONS_ENV,
    flex_decode_attention,
    list_width,
    paged_mask,
)
from batchgen.model.attention.step import decode_attention, decode_mask
from batchgen.stats.probe import call_seconds


def _time(fn: Callable[[], torch.Tensor], device: torch.device, reps: int) -> float:
    """Median seconds of reps calls (after the caller's warm-up)."""
    return statistics.median(call_seconds(fn, device, reps))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_shape(args, rows: int, device: torch.device, dtype: torch.dtype) -> dict:
    bs, hkv, d, g = args.block_size, args.kv_heads, args.head_dim, args.q_per_kv
    width = args.ctx // bs  # blocks a row holds
    num_blocks = rows * width + 1  # block 0: scratch
    gen = torch.Generator().manual_seed(rows)
    cache = PagedKVCache(num_blocks, bs, hkv, d, dtype, device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: rows * width]
    tables = tables.view(rows, width).to(device)
    lens = torch.full((rows,), args.ctx, device=device)
    q = torch.randn(rows, hkv * g, d, generator=gen).to(device, dtype)
    window = args.window or None

    sdpa_mask = decode_mask(lens, width * bs, window)
    mask = paged_mask(tables, lens, window, num_blocks, bs, list_width(cache, args.ctx))
    compiled = device.type == "cuda"

    def gather() -> torch.Tensor:
        return decode_attention(q, cache.k, cache.v, bs, tables, sdpa_mask)

    def flex() -> torch.Tensor:
        return flex_decode_attention(q, cache.k, cache.v, mask, window, bs, compiled)

    with torch.inference_mode():
        t0 = time.perf_counter()
        out_flex = flex()
        _sync(device)
        first_call = time.perf_counter() - t0  # the compile, on CUDA
        out_gather = gather()
        for _ in range(args.warmup):
            gather()
            flex()
        _sync(device)
        t_gather, t_flex = _time(gather, device, args.reps), _time(flex, device, args.reps)
    need = rows * args.ctx * hkv * d * 2 * cache.k.element_size()  # K and V, read once
    return dict(
        rows=rows,
        ctx=args.ctx,
        kv_heads=hkv,
        head_dim=d,
        q_per_kv=g,
        block_size=bs,
        window=window,
        kv_bytes=need,
        gather_ms=t_gather * 1e3,
        flex_ms=t_flex * 1e3,
        gather_over_flex=t_gather / t_flex,
        gather_gbps=need / t_gather / 1e9,  # on the bytes attention needs (it moves 3x)
        flex_gbps=need / t_flex / 1e9,
        flex_first_call_s=first_call,
        max_abs_diff=(out_flex.float() - out_gather.float()).abs().max().item(),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", default="32,256", help="comma-separated batch sizes")
    p.add_argument("--ctx", type=int, default=1024, help="context of every row (tokens)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-per-kv", type=int, default=4, help="query heads per kv head")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--options", default="[{}]", help="JSON list of flex kernel option sets")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.ctx % args.block_size:
        p.error("--ctx must be a multiple of --block-size")
    results = []
    for opts in json.loads(args.options):
        os.environ[FLEX_OPTIONS_ENV] = json.dumps(opts)
        for r in args.rows.split(","):
            results.append({"options": opts, **bench_shape(args, int(r), device, dtype)})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"decode attention of one layer on {name}, {args.dtype}, one call's median of {args.reps}"
    )
    print(
        "| flex options | rows x ctx | gather ms | flex ms | gather / flex | gather GB/s "
        "| flex GB/s | first flex call s | max diff |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {json.dumps(r['options'])} | {r['rows']} x {r['ctx']} | {r['gather_ms']:.3f} | "
            f"{r['flex_ms']:.3f} | "
            f"{r['gather_over_flex']:.2f}x | {r['gather_gbps']:.0f} | {r['flex_gbps']:.0f} | "
            f"{r['flex_first_call_s']:.1f} | {r['max_abs_diff']:.2e} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, dtype=args.dtype, results=results), f, indent=1)


if __name__ == "__main__":
    main()
