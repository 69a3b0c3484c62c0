"""What a quantized model is: method, backend, group size, and where each combination runs.

A `QuantScheme` is plain data, validated on construction and written out with `to_dict()`
into stats and output metadata, so a run always says how its weights were stored.
`SUPPORT` is the one table of which (backend, method) pairs run on which device and
dtype; asking for anything else raises `QuantUnavailableError` naming what does run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.choices import QuantBackend, QuantMethod  # declared once, with the other options
from batchgen.errors import QuantUnavailableError
from batchgen.model.checkpoint.prequantized import StoredScheme
from batchgen.model.families.transformer import LINEAR_LAYERS

INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 128  # torchao's default; quanto's CUDA int4 kernels need 128
# Only the decoder blocks' linear layers are quantized; embeddings, norms and lm_head keep
# the model dtype (lm_head is often tied to the embedding, where a quantized copy would add
# memory, and it is the layer most sensitive to weight error).
TARGETS = LINEAR_LAYERS

_ANY = None  # any model dtype
# (backend, method) -> {device type: dtypes the compiled path runs with, or _ANY}.
# CPU entries are measured: float32 in tests/test_quant.py, float16 and bfloat16 on a small
# compiled module. CUDA, measured on an H200 (scripts/gpu_check.sh, bf16, compiled decode):
# torchao int8/int4/fp8 and quanto int8; the other CUDA entries follow the libraries' kernels.
SUPPORT: dict[tuple[QuantBackend, QuantMethod], dict[str, tuple[torch.dtype, ...] | None]] = {
    (QuantBackend.TORCHAO, QuantMethod.INT8): {"cpu": _ANY, "cuda": _ANY},
    # CPU: tinygemm CPU kernel (Int4OpaqueTensor); CUDA: tinygemm tile-packed, bf16 only.
    (QuantBackend.TORCHAO, QuantMethod.INT4): {"cpu": _ANY, "cuda": (torch.bfloat16,)},
    (QuantBackend.TORCHAO, QuantMethod.FP8): {"cpu": _ANY, "cuda": _ANY},
    (QuantBackend.QUANTO, QuantMethod.INT8): {"cpu": _ANY, "cuda": _ANY},
    # bf16 int4 selects quanto's tinygemm tensor, which fails under torch.compile: on the CPU,
    # and on an H200 (torch 2.11, quanto 0.2.7: "TinyGemmWeightQBitsTensor object has no
    # attribute _scale" while inductor compiles the decode graph).
    (QuantBackend.QUANTO, QuantMethod.INT4): {
        "cpu": (torch.float32, torch.float16),
        "cuda": (torch.float32, torch.float16),
    },
    (QuantBackend.QUANTO, QuantMethod.FP8): {"cpu": _ANY, "cuda": _ANY},
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _runs(devices: dict, device_type: str, dtype: torch.dtype | None) -> bool:
    if device_type not in devices:
        return False
    dtypes = devices[device_type]
    return dtype is None or dtypes is None or dtype in dtypes


def available(device_type: str, dtype: torch.dtype | None = None) -> list[str]:
    """The "backend method" pairs that run on device_type (with dtype, if given); without
    a dtype, pairs limited to some dtypes say which."""
    out = []
    for (backend, method), devices in SUPPORT.items():
        if not _runs(devices, device_type, dtype):
            continue
        dtypes = devices[device_type]
        only = f" ({'/'.join(map(_dtype_name, dtypes))} only)" if dtypes and dtype is None else ""
        out.append(f"{backend.value} {method.value}{only}")
    return out


@dataclass(slots=True, frozen=True)
class QuantScheme:
    """Weight-only quantization of the decoder's linear layers.

    method NONE has no backend. group_size is int4's largest group of input channels and
    None for int8/fp8 (per output channel); layer_group_sizes, filled in by `quantize_model`,
    is the group each target layer got: the largest supported size up to group_size that
    divides its input width (a 32-wide layer gets 32 under the default 128). weight_format
    is the weight tensor type the backend produced ("A/B" if layers differ), also filled in
    by `quantize_model`. int8_layers, also filled in there, are the int4 targets whose input
    width no supported group size divides (on this rank: tensor parallelism splits some
    widths): they are kept at int8, per output channel, and have no group size."""

    method: QuantMethod = QuantMethod.NONE
    backend: QuantBackend | None = None
    group_size: int | None = None
    weight_format: str | None = None
    layer_group_sizes: tuple[tuple[str, int], ...] = ()  # (target, group size) per int4 target
    int8_layers: tuple[tuple[str, int], ...] = ()  # (target, input width) kept at int8
    # MoE layers' MLPs (3-D experts and router), kept at the model dtype: "layers.0.mlp", ...
    unquantized: tuple[str, ...] = ()
    # the quantized layers where they are not TARGETS (the transformers backend's own names)
    modules: tuple[str, ...] = ()
    # a pre-quantized checkpoint's own scheme, loaded as stored (model/checkpoint/prequantized.py):
    # nothing is quantized at load
    stored: StoredScheme | None = None

    def __post_init__(self) -> None:
        # Accept the plain strings the CLI and config files carry.
        object.__setattr__(self, "method", QuantMethod(self.method))
        if self.backend is not None:
            object.__setattr__(self, "backend", QuantBackend(self.backend))
        if self.method is QuantMethod.NONE:
            if self.backend is not None or self.group_size is not None:
                raise ValueError("quantize=none takes no backend and no group size")
            return
        if self.backend in (None, QuantBackend.AUTO):
            raise ValueError(f"quantize={self.method.value} needs a backend (torchao or quanto)")
        if self.method is QuantMethod.INT4 and self.checkpoint is None:
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(
                    f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"{self.method.value} is per output channel; group_size applies to int4 only"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not QuantMethod.NONE

    @property
    def checkpoint(self) -> str | None:
        """The stored checkpoint's scheme in words, e.g. "compressed-tensors float-quantized,
        per channel; activations: 8-bit float, dynamic per token"; None: quantized at load."""
        return None if self.stored is None else self.stored.describe()

    def group_size_of(self, target: str) -> int | None:
        """The group size the target layer (e.g. "mlp.w_out") is quantized with."""
        return dict(self.layer_group_sizes).get(target, self.group_size)

    def check_available(self, device_type: str, dtype: torch.dtype) -> None:
        if not self.enabled:
            return
        if not _runs(SUPPORT[(self.backend, self.method)], device_type, dtype):
            choices = available(device_type, dtype) or ["none"]
            raise QuantUnavailableError(
                f"quantize={self.method.value} with backend {self.backend.value} is not available "
                f"on {device_type} with {_dtype_name(dtype)}. Available there: "
                f"{', '.join(choices)}. "
                f"All combinations on {device_type}: {', '.join(available(device_type)) or 'none'}."
            )

    def to_dict(self) -> dict:
        if not self.enabled:
            return {"method": "none"}
        int8 = dict(self.int8_layers)
        sizes = {f"layers.*.{t}": self.group_size_of(t) for t in TARGETS if t not in int8}
        modules = list(self.modules) or [f"layers.*.{t}" for t in TARGETS]
        if self.stored is not None:  # as the checkpoint stores it
            granularity = self.stored.granularity
        elif not self.group_size:
            granularity = "per channel"
        elif len(set(sizes.values())) == 1:
            granularity = f"group of {next(iter(sizes.values()))}"
        else:
            granularity = f"groups of {'/'.join(map(str, sorted(set(sizes.values()))))}"
        # a checkpoint the transformers backend loads: transformers' quantizer decompressed it
        backend = "transformers" if self.stored and self.stored.transformers else None
        out = {
            "method": self.method.value,
            "backend": backend or self.backend.value,
            "granularity": granularity,
            "group_size": self.group_size,
            "modules": modules,
            "weight_format": self.weight_format,
        }
        if self.group_size:
            out["group_sizes"] = sizes
        if int8:  # int4 layers that no group size fits, kept at int8 per output channel
            out["int8_layers"] = {f"layers.*.{t}": f"{k} input features" for t, k in int8.items()}
        if self.unquantized:
            out["unquantized"] = list(self.unquantized)
        if self.checkpoint:
            out["checkpoint"] = self.checkpoint
        return out


def stored_quant_scheme(stored: StoredScheme) -> QuantScheme:
    """A pre-quantized checkpoint's QuantScheme: the checkpoint's, recorded as such (stats,
    the compile cache's key), never guessed."""
    return QuantScheme(QuantMethod(stored.weights), QuantBackend.TORCHAO, stored=stored)
