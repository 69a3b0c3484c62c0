"""torchao: quantized weights as tensor subclasses on the existing nn.Linear modules.

The model's modules stay as they are; only each target Linear's `weight` becomes a
torchao tensor (Int8Tensor, Int4OpaqueTensor, ...) whose matmul dispatches to the
quantized kernel, which torch.compile traces with fullgraph=True.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.model.quiet_import import quiet_torchao
from batchgen.quant.scheme import QuantMethod, QuantScheme


def _config(scheme: QuantScheme, device: torch.device, group_size: int | None):
    # set_inductor_config=False: torchao would otherwise flip process-wide inductor
    # settings, which also changes how an unquantized model in the same process compiles.
    with quiet_torchao():
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int4WeightOnlyConfig,
            Int8WeightOnlyConfig,
        )

    if scheme.method is QuantMethod.INT8:
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if scheme.method is QuantMethod.FP8:
        return Float8WeightOnlyConfig(set_inductor_config=False)
    if device.type == "cpu":
        # The stable Int4WeightOnlyConfig has no CPU layout in torchao 0.18 (its plain format
        # needs the CUDA-only mslk package); the CPU tinygemm layout lives in prototype.
        with quiet_torchao():
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    # tinygemm's CUDA kernel (aten._weight_int4pack_mm), the layout gpt-fast uses.
    return Int4WeightOnlyConfig(
        group_size=group_size, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
    )


def quantize_linears(
    parent: nn.Module, names: tuple[str, ...], scheme: QuantScheme, device: torch.device
) -> None:
    """Quantize the Linear submodules `names` of parent in place (parent is on device)."""
    with quiet_torchao():
        from torchao.quantization import quantize_

    # One pass per group size: int4 layers of one block may get different ones.
    by_size: dict[int | None, set[str]] = {}
    for name in names:
        by_size.setdefault(scheme.group_size_of(name), set()).add(name)
    for size, targets in by_size.items():
        config = _config(scheme, device, size)
        quantize_(parent, config, filter_fn=lambda _m, fqn, t=targets: fqn in t)
