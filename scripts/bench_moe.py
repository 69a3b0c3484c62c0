"""The MoE experts' two kernels (model/families/moe.py) against each other: `experts_grouped` (the
(token, expert) pairs sorted by expert, two `torch._grouped_mm` calls) and `experts_loop`
(per expert: gather its rows, two matmuls, add back), at decode and prefill token counts.

    python scripts/bench_moe.py                    # CPU float32, the two shapes below
    python scripts/bench_moe.py --dtype bfloat16 --device cuda

Routing is a real router's (random weights, softmax, top-k, renormalised), so experts get
uneven counts and some none. The kernels alternate call by call (A B A B) and each figure is
the median of --reps calls, so a busy machine's load falls on both alike; the two outputs are
compared (they add each token's experts in the same order: equal in float32).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from batchgen.model.families.moe import experts_grouped, experts_loop

# name -> (experts, experts per token, dim, expert intermediate)
SHAPES = {
    "qwen3-moe-60m": (16, 4, 384, 256),  # scripts/bench_models.py's, a layer
    "medium": (64, 8, 1024, 384),  # Qwen3-30B-A3B's routing (8 of 128) at half the sizes
}


def inputs(shape: tuple[int, int, int, int], tokens: int, dtype, device, seed: int = 0):
    e, k, dim, i = shape
    g = torch.Generator().manual_seed(seed)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device, dtype)

    x = rand(tokens, dim)
    probs = torch.softmax(x.float() @ rand(e, dim).float().t(), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    w_in, w_out = rand(e, 2 * i, dim, scale=dim**-0.5), rand(e, dim, i, scale=i**-0.5)
    return x, w_in, w_out, weights, experts, "silu"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", default="1,4,16,64,256,1024")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    print(
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} · {platform.machine()}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}, {a.device} {a.dtype}"
    )
    print("| shape | tokens | grouped ms | loop ms | loop / grouped | max abs diff |")
    print("|---|---|---|---|---|---|")
    kernels = {"grouped": experts_grouped, "loop": experts_loop}
    for name, shape in SHAPES.items():
        for t in map(int, a.tokens.split(",")):
            args = inputs(shape, t, dtype, a.device)
            times: dict[str, list[float]] = {n: [] for n in kernels}
            with torch.inference_mode():
                outs = {n: f(*args) for n, f in kernels.items()}  # warm-up
                for _ in range(a.reps):
                    for n, f in kernels.items():
                        sync(a.device)
                        t0 = time.perf_counter()
                        f(*args)
                        sync(a.device)
                        times[n].append(time.perf_counter() - t0)
            g, lp = (statistics.median(times[n]) * 1e3 for n in kernels)
            diff = (outs["grouped"].float() - outs["loop"].float()).abs().max().item()
            print(f"| {name} | {t} | {g:.3f} | {lp:.3f} | {lp / g:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
