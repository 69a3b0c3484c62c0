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

from batchgen.model.families.transformer import LINEAR_LAYERS, MLP, activation

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
    it keeps the (out, in) shape and the byte count of the plain one. rows: a slice of the
    linear's output features to keep (a fused layer's part)."""

    def __init__(self, linear: nn.Linear, rows: slice = slice(None)) -> None:
        super().__init__()
        # a column-major LM head: one row-major copy
        plain = linear.weight.detach()[rows].contiguous()
        self.out_features, self.in_features = plain.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach()[rows].clone(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedGatedMLP(nn.Module):
    """A gated MLP (Llama's) with its fused [gate; up] weight packed as two layers: the
    activation then reads a contiguous gate and the product is taken in place, where the
    fused layer's (T, 2 x intermediate) output made both read strided halves and allocate
    twice. Same values as MLP.forward; the mixed job's prompts alone (192 rows, prefill only)
    ran 1.10x faster with it (docs/benchmarks.md)."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        half = mlp.w_in.out_features // 2
        self.act = mlp.act
        self.w_gate = PackedLinear(mlp.w_in, slice(0, half))
        self.w_up = PackedLinear(mlp.w_in, slice(half, None))
        self.w_out = PackedLinear(mlp.w_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = activation(self.act, self.w_gate(x))  # a new tensor: the product goes in place
        return self.w_out(h.mul_(self.w_up(x)))


def pack_linears(model: nn.Module) -> int:
    """Replace the decoder blocks' linear layers and an untied LM head with PackedLinear (a
    gated MLP with PackedGatedMLP), in place. Returns how many weights were packed."""
    packed = 0
    for block in model.layers:
        gated = isinstance(block.mlp, MLP) and block.mlp.gated
        moe = not isinstance(block.mlp, MLP)  # its experts stay 3-D (model/families/moe.py)
        for name in LINEAR_LAYERS:
            if not ((gated or moe) and name.startswith("mlp.")):
                block.set_submodule(name, PackedLinear(block.get_submodule(name)))
                packed += 1
        if gated:  # gate, up and down
            block.mlp = PackedGatedMLP(block.mlp)
            packed += 3
    if model.lm_head.weight is not model.embed.weight:
        model.lm_head = PackedLinear(model.lm_head)
        packed += 1
    return packed
