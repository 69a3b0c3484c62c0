"""The hardware ceilings of this machine and the fastest a workload could possibly run.

Two ceilings are measured in the same run as the benchmark (datasheet rates are only
leads): memory bandwidth, from a large tensor copy (bytes read + bytes written over the
time), and the matrix-multiply rate, from a large matmul on random data in the model's
dtype; each is the fastest of several timed repetitions. A workload's floor is then, step by step, the larger of its bytes over the
bandwidth and its FLOPs over the matmul rate:

- a decode step of a batch must read every weight once (the input embedding excepted:
  it is a gather) plus the live KV cache of every row still generating, and does
  ~2 * params FLOPs per row plus 4 * layers * heads * head_dim * context for attention;
- a prefill must do 2 * (layer params) FLOPs per prompt token, the causal attention, and
  the LM head once per row (only the last position's logits are needed).

Only real rows and real tokens count: padding and dummy rows are the engine's waste,
which is what the comparison should show.

    python scripts/roofline.py --device cuda --dtype bfloat16   # prints both ceilings
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch


def _timed(fn: Callable[[], None], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Fastest of reps timed calls of fn, after warmup calls: a ceiling is the best the
    machine did, and on a shared machine the median mostly measures the neighbours."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


def _copy_seconds(n: int, device: torch.device, reps: int) -> float:
    src = torch.randn(n, device=device)  # random, never zeros (they can run faster)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, reps)
    assert torch.equal(dst[-1024:], src[-1024:]), "copy did not write its output"
    return seconds


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return _timed(lambda: torch.mm(a, b), device, reps)


@dataclass(slots=True)
class Ceilings:
    device: str
    dtype: str
    bandwidth_Bps: float  # bytes read + written per second, large copy
    matmul_flops: float  # FLOP/s of an n x n x n matmul in dtype
    copy_bytes: int
    matmul_n: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure(
    device: str | torch.device,
    dtype: torch.dtype,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    reps: int = 10,
) -> Ceilings:
    """Measure both ceilings; sizes default to well past the caches of each device type."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if cuda else 256 << 20)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    n = copy_bytes // 4
    copy_s = _copy_seconds(n, device, reps)
    mm_s = _matmul_seconds(matmul_n, dtype, device, reps if cuda else 3)
    if cuda:
        torch.cuda.empty_cache()
    return Ceilings(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        bandwidth_Bps=2 * n * 4 / copy_s,
        matmul_flops=2 * matmul_n**3 / mm_s,
        copy_bytes=n * 4,
        matmul_n=matmul_n,
    )


@dataclass(slots=True, frozen=True)
class ModelCost:
    """What one token costs a decoder, from its architecture."""

    layer_params: int  # all decoder-block matrices
    head_params: int  # the LM head (vocab x dim), read every step even when tied
    kv_bytes_per_token: int  # all layers, K and V
    attn_width: int  # layers * heads * head_dim: attention FLOPs scale with it
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg, dtype_bytes: int, weight_bytes: int | None = None) -> ModelCost:
        """cfg: a batchgen ModelConfig."""
        attn = cfg.dim * cfg.qkv_dim + cfg.n_heads * cfg.head_dim * cfg.dim
        mlp = (3 if cfg.gated_mlp else 2) * cfg.dim * cfg.intermediate_size
        return cls(
            layer_params=cfg.n_layers * (attn + mlp),
            head_params=cfg.vocab_size * cfg.dim,
            kv_bytes_per_token=cfg.kv_bytes_per_token(dtype_bytes),
            attn_width=cfg.n_layers * cfg.n_heads * cfg.head_dim,
            dtype_bytes=dtype_bytes,
        )

    @property
    def weight_bytes(self) -> int:
        """Weights a decode step must read."""
        return (self.layer_params + self.head_params) * self.dtype_bytes


@dataclass(slots=True)
class Bound:
    """The floor of a phase: seconds at the ceilings, and what set it."""

    seconds: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    steps: int = 0
    tokens: int = 0  # useful tokens the phase produces (decode) or reads (prefill)
    memory_bound_steps: int = 0

    def add(self, nbytes: float, flops: float, c: Ceilings, tokens: int) -> None:
        t_mem, t_mm = nbytes / c.bandwidth_Bps, flops / c.matmul_flops
        self.seconds += max(t_mem, t_mm)
        self.bytes += nbytes
        self.flops += flops
        self.steps += 1
        self.tokens += tokens
        self.memory_bound_steps += t_mem >= t_mm

    def to_dict(self) -> dict:
        return asdict(self)


def decode_bound(
    batches: Sequence[Sequence[tuple[int, int]]], cost: ModelCost, c: Ceilings
) -> Bound:
    """batches: per batch, (prompt_len, new_tokens) of its real rows. The first new token
    comes from prefill; step s (1 <= s < new_tokens) makes token s+1 with p + s tokens in
    the row's cache."""
    bound = Bound()
    for rows in batches:
        for s in range(1, max(n for _, n in rows)):
            ctx = [p + s for p, n in rows if n > s]
            nbytes = cost.weight_bytes + sum(ctx) * cost.kv_bytes_per_token
            flops = 2 * (cost.layer_params + cost.head_params) * len(
                ctx
            ) + 4 * cost.attn_width * sum(ctx)
            bound.add(nbytes, flops, c, len(ctx))
    return bound


def prefill_bound(
    batches: Sequence[Sequence[tuple[int, int]]], cost: ModelCost, c: Ceilings
) -> Bound:
    bound = Bound()
    for rows in batches:
        lens = [p for p, _ in rows]
        flops = sum(
            2 * cost.layer_params * p + 2 * cost.head_params + 2 * cost.attn_width * p * p
            for p in lens
        )
        nbytes = cost.weight_bytes + sum(lens) * cost.kv_bytes_per_token  # weights in, KV out
        bound.add(nbytes, flops, c, sum(lens))
    return bound


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="matmul dtype (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--copy-mib", type=int, default=None)
    p.add_argument("--matmul-n", type=int, default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    dtype = dtype or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    copy_bytes = args.copy_mib << 20 if args.copy_mib else None
    c = measure(args.device, dtype, copy_bytes, args.matmul_n)
    print(
        f"copy bandwidth (read + write): {c.bandwidth_Bps / 1e9:.1f} GB/s ({c.copy_bytes >> 20} MiB)"
    )
    print(f"matmul {c.dtype} n={c.matmul_n}: {c.matmul_flops / 1e12:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
