"""The hardware ceilings of this machine and the fastest a workload could possibly run.

Two ceilings are measured in the same run as the benchmark (datasheet rates are only
leads): memory bandwidth, from a large tensor copy (bytes read + bytes written over the
time), and the matrix-multiply rate, from a large matmul on random data in the model's
dtype; each is the fastest of several timed repetitions. A workload's floor is then, step by
step, the larger of its bytes over the bandwidth and its FLOPs over the matmul rate:

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# The ceilings' probe and the per-token costs live in the package (batchgen/stats/probe.py,
# stats/roofline.py), which uses them for MFU and MBU in every run's stats.json.
from batchgen.stats.probe import Ceilings, measure
from batchgen.stats.roofline import ModelCost

__all__ = [
    "Bound",
    "Ceilings",
    "ModelCost",
    "decode_bound",
    "job_floor_seconds",
    "measure",
    "prefill_bound",
]


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


def job_floor_seconds(
    model_dir: Path, prompts: Sequence[str], news: Sequence[int], matmul_flops: float
) -> float:
    """A whole job's matmul FLOPs (every prompt and output token through the blocks, the LM
    head for output tokens only, attention over each token's context) at the measured rate.
    Prompts are bench_models' word prompts: one word, one token."""
    from batchgen.model.families.hf_config import config_from_hf, read_hf_config

    cost = ModelCost.from_config(config_from_hf(read_hf_config(model_dir)), 4)
    flops = 0.0
    for p, n in zip(prompts, news, strict=True):
        L = len(p.split())
        ctx = L * (L + 1) / 2 + sum(L + i for i in range(n))  # keys each query attends to
        flops += 2 * cost.layer_params * (L + n) + 2 * cost.head_params * n
        flops += 4 * cost.attn_width * ctx
    return flops / matmul_flops


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
        f"copy bandwidth (read + write): {c.bandwidth_Bps / 1e9:.1f} GB/s "
        f"({c.copy_bytes >> 20} "
        f"MiB)"
    )
    print(f"matmul {c.dtype} n={c.matmul_n}: {c.matmul_flops / 1e12:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
