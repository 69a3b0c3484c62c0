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

On the CPU (issue 41) it times CPU seconds (process_time: every thread's), the paths interleaved
call by call, and also the gather into new tensors each call (the path before the gather buffer,
"fresh") and, with --compile-flex, flex compiled by inductor (its C++ flex template) with the
paged mask as built for the engine and with "full" block lists (every block but a row's last,
partly filled one skips mask_mod; no window only). glibc's malloc is tuned as a loaded CPU model
tunes it (model/host_malloc.py: freed blocks under 32 MiB kept for the next), unless
--no-malloc-tuning:

    python scripts/bench_paged_decode.py --device cpu --dtype float32 --threads 1 \\
        --rows 32,128,256 --ctx 1024 --kv-heads 2 --head-dim 64 --q-per-kv 4 --compile-flex
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.paged_flex import (
    FLEX_OPTIONS_ENV,
    _compiled_flex,
    flex_decode_attention,
    list_width,
    paged_mask,
)
from batchgen.model.attention.step import decode_attention, decode_mask
from batchgen.model.host_malloc import keep_freed_memory
from batchgen.stats.probe import call_seconds


def _times(fns: dict[str, Callable[[], torch.Tensor]], device: torch.device, reps: int) -> dict:
    """Median seconds of reps calls of each fn (after the caller's warm-up), interleaved call
    by call: on the CPU, CPU seconds of the process (every thread's), else the GPU's."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if device.type == "cpu":
                t0 = time.process_time()
                fn()
                times[name].append(time.process_time() - t0)
            else:
                times[name] += call_seconds(fn, device, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def full_block_mask(tables, lens, pool_blocks: int, bs: int, queries: int) -> BlockMask:
    """The paged mask with "full" lists (no window): a row's blocks but its last are full
    (mask_mod skipped), the last one partly filled (mask_mod: the slot below the row's length).
    A variant for the CPU template, measured here; the engine's mask lists every block."""
    rows, n = tables.shape
    last = ((lens - 1) // bs).long()
    partial = torch.zeros(rows, pool_blocks, dtype=torch.int32, device=tables.device)
    partial[:, 0] = tables.gather(1, last[:, None])[:, 0]
    full = torch.zeros_like(partial)
    full[:, :n] = tables  # the first `last` of them read
    last_slot = ((lens - 1) % bs).to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx % bs <= last_slot[b]

    return BlockMask.from_kv_blocks(
        torch.ones(rows, 1, 1, dtype=torch.int32, device=tables.device),
        partial[:, None, None],
        last.to(torch.int32)[:, None, None],
        full[:, None, None],
        BLOCK_SIZE=(128, bs),
        mask_mod=mask_mod,
        seq_lengths=(queries, pool_blocks * bs),
        compute_q_blocks=False,
    )


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
    # contexts end anywhere in their last block, as in a real batch
    lens = args.ctx - torch.arange(rows, device=device) % bs
    q = torch.randn(rows, hkv * g, d, generator=gen).to(device, dtype)
    window = args.window or None

    sdpa_mask = decode_mask(lens, width * bs, window)
    mask = paged_mask(tables, lens, window, num_blocks, bs, list_width(cache, args.ctx))
    compiled = device.type == "cuda" or args.compile_flex
    buffer = cache.gather_buffer()  # None off the CPU

    fns = {
        "gather": lambda: decode_attention(
            q, cache.k, cache.v, bs, tables, sdpa_mask, buffer=buffer
        ),
        "flex": lambda: flex_decode_attention(q, cache.k, cache.v, mask, window, bs, compiled),
    }
    if device.type == "cpu":
        fns["fresh"] = lambda: decode_attention(q, cache.k, cache.v, bs, tables, sdpa_mask)
    if device.type == "cpu" and args.compile_flex and window is None:
        full = full_block_mask(tables, lens, num_blocks, bs, g)
        kp, vp = (x.permute(1, 0, 2)[None] for x in (cache.k, cache.v))
        fns["flex_full"] = lambda: _compiled_flex()(
            q.view(rows, hkv, g, d).clone(), kp, vp, block_mask=full, scale=d**-0.5
        ).view(rows, hkv * g, d)

    with torch.inference_mode():
        t0 = time.perf_counter()
        fns["flex"]()
        _sync(device)
        first_call = time.perf_counter() - t0  # the compile, on CUDA
        outs = {name: fn() for name, fn in fns.items()}
        for _ in range(args.warmup):
            for fn in fns.values():
                fn()
        _sync(device)
        t = _times(fns, device, args.reps)
    diff = {n: (o.float() - outs["gather"].float()).abs().max().item() for n, o in outs.items()}
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
        **{f"{n}_ms": t[n] * 1e3 for n in fns},
        gather_over_flex=t["gather"] / t["flex"],
        gather_gbps=need / t["gather"] / 1e9,  # on the bytes attention needs (it moves 3x)
        flex_gbps=need / t["flex"] / 1e9,
        flex_first_call_s=first_call,
        max_abs_diff=max(diff.values()),
        diffs=diff,  # each path's against the gather (fresh: bitwise the same)
        flex_compiled=compiled,
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
    p.add_argument("--compile-flex", action="store_true", help="on the CPU too (inductor's)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--no-malloc-tuning", action="store_true", help="glibc's malloc as it starts")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = device.type == "cpu" and not args.no_malloc_tuning and keep_freed_memory()
    if args.ctx % args.block_size:
        p.error("--ctx must be a multiple of --block-size")
    results = []
    for opts in json.loads(args.options):
        os.environ[FLEX_OPTIONS_ENV] = json.dumps(opts)
        for r in args.rows.split(","):
            results.append({"options": opts, **bench_shape(args, int(r), device, dtype)})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cpu":
        name += f", {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}"
        name += ", malloc tuned" if tuned else ", malloc untuned"
    print(
        f"decode attention of one layer on {name}, {args.dtype}, one call's median of {args.reps}"
    )
    if device.type == "cpu":  # ms of CPU time per call, each path
        paths = [n for n in ("fresh", "gather", "flex", "flex_full") if f"{n}_ms" in results[0]]
        head = " | ".join(f"{n} ms" for n in paths)
        print(f"| rows x ctx | {head} | fresh / gather | fresh diff | max diff |")
        print("| --- |" + " ---: |" * (len(paths) + 3))
        for r in results:
            cells = " | ".join(f"{r[f'{n}_ms']:.2f}" for n in paths)
            ratio = r["fresh_ms"] / r["gather_ms"]
            diffs = f"{r['diffs']['fresh']:.1e} | {r['max_abs_diff']:.1e}"
            print(f"| {r['rows']} x {r['ctx']} | {cells} | {ratio:.2f}x | {diffs} |")
    else:
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
