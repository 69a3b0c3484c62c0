"""oneDNN-packed linear weights for eager float32 runs on the CPU.

`F.linear` hands the BLAS a row-major weight, and the BLAS repacks it into its own blocked
layout on every call; at decode sizes (1-64 rows) that repacking is a large part of the call.
oneDNN can pack a weight once (`torch.ops.mkldnn._reorder_linear_weight`) and multiply from
the packed copy (`torch.ops.mkldnn._linear_pointwise`), which is what inductor's freezing does
on the CPU. `scripts/bench_linear_layouts.py` measures the gain per row count
(docs/benchmarks.md): 1.2-1.6x on an AVX-512 Xeon, 1.8-2.7x on an AVX2 one.

The packed weight replaces the plain one (no second copy), is an opaque tensor that only
`_linear_pointwise` reads, and so is packed after everything that rewrites weights (LoRA
merge) and before the tensor-parallel hooks. Not used with --compile (a graph cannot take an
opaque tensor as an input; inductor packs by itself), with quantized weights, nor for an LM
head tied to the embedding (packing would hold the table twice). BATCHGEN_PACKED_WEIGHTS=0
turns it off, for benchmarking the plain path.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from batchgen.model.transformer import LINEAR_LAYERS

PACKED_WEIGHTS_ENV = "BATCHGEN_PACKED_WEIGHTS"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pack_linears applies: float32 on a CPU whose torch has oneDNN."""
    if os.environ.get(PACKED_WEIGHTS_ENV, "1") == "0":
        return False
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """y = x @ W^T + b from W packed once by oneDNN. `weight` is the packed (opaque) tensor:
    it keeps the (out, in) shape and the byte count of the plain one."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        plain = linear.weight.detach().contiguous()  # a column-major LM head: one row-major copy
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace the decoder blocks' linear layers and an untied LM head with PackedLinear, in
    place. Returns how many were packed."""
    packed = 0
    for block in model.layers:
        for name in LINEAR_LAYERS:
            block.set_submodule(name, PackedLinear(block.get_submodule(name)))
            packed += 1
    if model.lm_head.weight is not model.embed.weight:
        model.lm_head = PackedLinear(model.lm_head)
        packed += 1
    return packed
