"""--quantize on the transformers backend: quantize.py's pass over a transformers model. Every
nn.Linear in its decoder layers (attention, dense MLP) is quantized by the scheme's backend,
a layer at a time on the device, so the device never holds more than one layer in float; the
embeddings, norms and LM head keep the model dtype, as natively. int8 and fp8 only (one scale
per output channel): int4's group sizes are chosen per native layer kind. A model with 3-D
expert weights is refused before loading (job/backend_options.py). A pre-quantized checkpoint
the backend loads (transformers decompressed it at load) is left as it is, said in one line."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from batchgen.model.checkpoint.dequantized import note
from batchgen.model.hf.backend import HFModel
from batchgen.model.memory import weight_bytes
from batchgen.quant.quantize import _BACKENDS
from batchgen.quant.scheme import QuantScheme

log = logging.getLogger(__name__)


def quantize_hf_model(
    model: HFModel, scheme: QuantScheme, device: str | torch.device
) -> QuantScheme:
    """Quantize the decoder layers' linears of model in place and leave it all on device;
    returns the scheme with weight_format filled in."""
    device = torch.device(device)
    if not scheme.enabled:
        model.to(device)
        return scheme
    if scheme.stored is not None:  # a checkpoint transformers decompressed at load: said here
        model.to(device)
        dtype = model.embed.weight.dtype
        log.warning("%s", note(scheme.stored, False, dtype, weight_bytes(model), device.type))
        return dataclasses.replace(scheme, weight_format=str(dtype).removeprefix("torch."))
    scheme.check_available(device.type, model.embed.weight.dtype)
    backend = _BACKENDS[scheme.backend]
    formats, modules = set(), set()
    for layer in model.hf.get_decoder().layers:
        layer.to(device)
        names = tuple(n for n, m in layer.named_modules() if isinstance(m, nn.Linear))
        backend.quantize_linears(layer, names, scheme, device)
        formats |= {type(layer.get_submodule(n).weight).__name__ for n in names}
        modules |= {f"layers.*.{n}" for n in names}
    model.to(device)
    model.requires_grad_(False)  # quanto's fresh Parameters require grad (quantize.py)
    return dataclasses.replace(
        scheme, weight_format="/".join(sorted(formats)), modules=tuple(sorted(modules))
    )
