"""The quantization pass: float model on the host in, quantized model on the device out.

Blocks are moved to the device one at a time and quantized there, so the device never
holds more than one block in full precision (and packed int4 layouts, which differ
between CPU and CUDA kernels, are built for the device that runs them).

A MoE layer (model/families/moe.py) has no MLP linears: its experts are 3-D weights that the
backends' linear-layer passes do not take, so they and the router keep the model dtype; its
attention is quantized, as a dense layer's MLP is (docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from batchgen.model.families.moe import MoE
from batchgen.model.families.transformer import Transformer
from batchgen.quant import quanto_backend, torchao_backend
from batchgen.quant.scheme import (
    DEFAULT_INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    TARGETS,
    QuantBackend,
    QuantMethod,
    QuantScheme,
    QuantUnavailableError,
)

log = logging.getLogger(__name__)

_BACKENDS = {QuantBackend.TORCHAO: torchao_backend, QuantBackend.QUANTO: quanto_backend}

# What backend="auto" picks, from CPU measurements and, for CUDA, published figures;
# docs/quantization.md has the numbers. torchao is as fast as quanto or faster in every
# CPU cell measured, except int4 with float32/float16 activations, where torchao's CPU
# int4 kernel takes a slow path (2-26x slower than quanto in scripts/bench_quant.py) and
# quanto is picked.
DEFAULT_OVERRIDES = {
    ("cpu", QuantMethod.INT4, torch.float32): QuantBackend.QUANTO,
    ("cpu", QuantMethod.INT4, torch.float16): QuantBackend.QUANTO,
}


def default_backend(
    device_type: str, method: QuantMethod | None = None, dtype: torch.dtype | None = None
) -> QuantBackend:
    """torchao, or the measured better one for (device, method, dtype)."""
    best = DEFAULT_OVERRIDES.get((device_type, method, dtype))
    return best or QuantBackend.TORCHAO


def make_scheme(
    method: str,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    group_size: int | None = None,
) -> QuantScheme:
    """Resolve "auto" and the default group size, and check that the result runs on
    device with dtype; raises QuantUnavailableError otherwise."""
    method = QuantMethod(method)
    if method is QuantMethod.NONE:
        return QuantScheme()
    device = torch.device(device)
    auto = backend == "auto"
    resolved = default_backend(device.type, method, dtype) if auto else QuantBackend(backend)
    if method is QuantMethod.INT4 and group_size is None:
        group_size = DEFAULT_INT4_GROUP_SIZE
    scheme = QuantScheme(method, resolved, group_size)
    scheme.check_available(device.type, dtype)
    return scheme


def block_targets(block: nn.Module) -> tuple[str, ...]:
    """The TARGETS block holds as linear layers: a MoE layer's are its attention's."""
    moe = isinstance(block.mlp, MoE)
    return tuple(t for t in TARGETS if not (moe and t.startswith("mlp.")))


def layer_group_sizes(
    model: Transformer, scheme: QuantScheme
) -> tuple[dict[str, int], dict[str, int]]:
    """Per target layer, the largest supported group size up to scheme.group_size that
    divides its input width in every block; and the targets none divides, with their width,
    which stay int8 (a real checkpoint can have one odd layer). The model is this rank's
    part, so a width tensor parallelism split is judged as split. QuantUnavailableError if
    no target can take int4 at all."""
    sizes, int8 = {}, {}
    for name in TARGETS:
        widths = {
            block.get_submodule(name).in_features
            for block in model.layers
            if name in block_targets(block)
        }
        if not widths:  # every layer MoE: no MLP linears
            continue
        fits = [
            g
            for g in INT4_GROUP_SIZES
            if g <= scheme.group_size and all(k % g == 0 for k in widths)
        ]
        if fits:
            sizes[name] = max(fits)
        else:
            int8[name] = min(widths)
    if not sizes:
        raise QuantUnavailableError(
            f"int4 groups input channels in {', '.join(map(str, INT4_GROUP_SIZES))}s, and none "
            f"of those up to {scheme.group_size} divides the input features of any quantized "
            f"layer ({', '.join(f'{t}: {k}' for t, k in int8.items())}); use --quantize int8 or "
            "fp8 for this model"
        )
    return sizes, int8


def quantize_model(
    model: Transformer, scheme: QuantScheme, device: str | torch.device
) -> QuantScheme:
    """Quantize model's decoder linears in place and leave the whole model on device.

    Returns the scheme with weight_format filled in (the tensor type the backend chose)."""
    device = torch.device(device)
    if not scheme.enabled:
        model.to(device)
        return scheme
    moe = tuple(f"layers.{i}.mlp" for i, b in enumerate(model.layers) if isinstance(b.mlp, MoE))
    if scheme.checkpoint is not None:  # loaded as the checkpoint stores it: nothing to do
        model.to(device)  # (a MoE layer's experts and router: dequantized at load)
        return dataclasses.replace(scheme, weight_format=_formats(model), unquantized=moe)
    scheme.check_available(device.type, model.embed.weight.dtype)
    int8: dict[str, int] = {}
    if scheme.group_size is not None:
        sizes, int8 = layer_group_sizes(model, scheme)
        scheme = dataclasses.replace(
            scheme, layer_group_sizes=tuple(sizes.items()), int8_layers=tuple(int8.items())
        )
        for name, width in int8.items():
            log.warning(
                "int4: no group size in %s up to %d divides the %d input features of "
                "layers.*.%s; that layer is kept at int8",
                "/".join(map(str, INT4_GROUP_SIZES)),
                scheme.group_size,
                width,
                name,
            )
    backend = _BACKENDS[scheme.backend]
    as_int8 = QuantScheme(QuantMethod.INT8, scheme.backend)
    if moe:
        log.warning("--quantize: the MoE layers' experts and routers keep the model dtype")
        scheme = dataclasses.replace(scheme, unquantized=moe)
    for block in model.layers:
        block.to(device)
        targets = block_targets(block)
        backend.quantize_linears(block, tuple(t for t in targets if t not in int8), scheme, device)
        if any(t in int8 for t in targets):
            backend.quantize_linears(block, tuple(t for t in targets if t in int8), as_int8, device)
    for name in ("embed", "pos_embed", "norm", "lm_head"):
        module = getattr(model, name)
        if module is not None:
            module.to(device)
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    # quanto's QLinear makes fresh Parameters that require grad; the runner calls the
    # model outside no_grad, so that would record autograd graphs and, through the KV
    # cache writes, flip the cache buffers to requires_grad and force a recompile.
    model.requires_grad_(False)
    return dataclasses.replace(scheme, weight_format=_formats(model))


def _formats(model: Transformer) -> str:
    """The weight tensor types of the target layers: quanto picks one (and a kernel) per layer
    shape, so every one chosen is recorded."""
    formats = {_format(b.get_submodule(n).weight) for b in model.layers for n in block_targets(b)}
    return "/".join(sorted(formats))


def _format(w: torch.Tensor) -> str:
    """A weight's tensor type; a plain one's dtype (a stored format dequantized at load)."""
    return type(w).__name__ if is_traceable_wrapper_subclass(w) else str(w.dtype).split(".")[-1]
