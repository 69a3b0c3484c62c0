"""Decode-sized linear layers on the CPU: `F.linear` on row-major weights against oneDNN's
prepacked weights (`torch.ops.mkldnn._reorder_linear_weight` once, `_linear_pointwise` per
call), over a whole model's decoder weights and LM head, so the weights stream from memory as
in a decode step. The study behind docs/benchmarks.md's "oneDNN-packed weights" paragraph.

    python scripts/bench_linear_layouts.py                 # the 55M Llama's shapes, 2 threads
    python scripts/bench_linear_layouts.py --rows 8,64 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# llama-55m (scripts/bench_models.py): hidden 512, 8 layers, GQA 8/2 of 64, MLP 1536, 32k vocab
LAYER = [(768, 512), (512, 512), (3072, 512), (512, 1536)]  # (out, in): qkv, o, gate+up, down


def _median_s(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,16,32,64,128", help="rows per call (comma-separated)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(a.layers) for o, i in LAYER]
    weights.append(torch.randn(a.vocab, 512, generator=g) * 0.02)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    print(f"{a.layers} layers + a {a.vocab}-row LM head, {a.threads} threads, median of {a.reps}")
    print("| rows | F.linear ms | GFLOP/s | packed ms | GFLOP/s | packed / linear | max diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with torch.no_grad():
        for m in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in weights}}

            def plain(xs=xs):
                return [F.linear(xs[w.shape[1]], w) for w in weights]

            def onednn(xs=xs):
                return [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], pw, None, "none", [], "")
                    for w, pw in zip(weights, packed, strict=True)
                ]

            flops = 2 * m * sum(w.numel() for w in weights)
            t_plain, t_packed = _median_s(plain, a.reps), _median_s(onednn, a.reps)
            diff = max(float((u - v).abs().max()) for u, v in zip(plain(), onednn(), strict=True))
            print(
                f"| {m} | {t_plain * 1e3:.2f} | {flops / t_plain / 1e9:.0f} | {t_packed * 1e3:.2f} "
                f"| {flops / t_packed / 1e9:.0f} | {t_plain / t_packed:.2f}x | {diff:.1e} |"
            )


if __name__ == "__main__":
    main()
