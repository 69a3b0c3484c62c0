"""optimum-quanto: each target nn.Linear is replaced by a quanto QLinear whose frozen
weight is a quanto tensor (WeightQBytesTensor for int8/fp8, WeightQBitsTensor or a
kernel-specific subclass for int4)."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.model.quiet_import import quiet_torchao
from batchgen.quant.scheme import QuantMethod, QuantScheme


def quantize_linears(
    parent: nn.Module, names: tuple[str, ...], scheme: QuantScheme, device: torch.device
) -> None:
    """Quantize the Linear submodules `names` of parent in place (parent is on device)."""
    with quiet_torchao():  # optimum-quanto imports torchao where it is installed
        from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize

    qtype = {QuantMethod.INT8: qint8, QuantMethod.INT4: qint4, QuantMethod.FP8: qfloat8}
    quantize(parent, weights=qtype[scheme.method], include=list(names))
    if scheme.method is QuantMethod.INT4:
        # quanto picks a group size from each layer's width; use the scheme's instead so
        # the recorded group size is the one applied. freeze() reads this attribute.
        for name in names:
            parent.get_submodule(name).weight_group_size = scheme.group_size_of(name)
    freeze(parent)
