"""Stored weights that no kernel here takes, dequantized at load into the model dtype: each as
soon as it and its scale are read, so no float copy of the model is made beside the stored one
(the issue's rule: kept quantized where a kernel runs them, dequantized at load where none
does, said in one line).

- FP8 on a device with no fp8 matmul (the CPU; `on_device`). torchao's `Float8Tensor` there
  dequantizes its weight at every call: a 334 M Llama decoded at 0.13x bf16's rate
  (docs/quantization.md). Each fp8 linear is dequantized once instead, when its rows and
  scale rows are all placed (stored_linears.py): w = q * scale in float32, then cast, as
  torchao computes it at each call, so the numbers are the same. A checkpoint's input
  quantization (activation_quant.py) still runs. On CUDA the weights stay `Float8Tensor`s.
- A MoE model's experts (and its router where a tool quantized it), any stored format: the
  experts are held stacked (model/families/moe.py) and run by one grouped matmul of float
  weights; there is no grouped int4 or fp8 expert kernel here. `moe_dequantized` pairs each
  expert's weight with its scale as they are read (in either order, in any file) and hands
  on the float weight, which the loader stacks as a float checkpoint's; INT4 experts come
  unpacked to q - z and group scales (int4_tensors.py) and are dequantized the same way, one
  expert at a time. The attention keeps its stored form.

Refused before any weight is read (`check_experts`): experts stored 3-D (one tensor for all of
them), and experts whose inputs the checkpoint quantizes (W8A8, FP8_DYNAMIC, static input
scales), which the expert op would run on float inputs: not the checkpoint's model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.files import WholeReads, reading, stored_dtype
from batchgen.model.checkpoint.format import quantized_tensors
from batchgen.model.checkpoint.moe_names import is_moe_param
from batchgen.model.checkpoint.names import weight_slot
from batchgen.model.checkpoint.prequantized import StoredScheme, scale_rows
from batchgen.model.config import ModelConfig
from batchgen.model.memory import format_bytes

_FP8_MATMUL = ("cuda",)  # device types where stored fp8 weights stay Float8Tensors
# a stored 3-D experts tensor: "model.layers.0.mlp.experts.gate_up_proj (F8_E4M3)"
_STACKED = re.compile(r"\.experts\.(?:gate_up_proj|down_proj)(?![a-z])")
_FIX = "use the model's bf16 release (with --quantize for its attention)"


def fp8_gemm_capable(device: torch.device | str) -> bool:
    """CUDA sm90+ (H100, H200): torch._scaled_mm multiplies fp8 by fp8 with a scale per row
    of each side (the checkpoint's per-channel weight scales, per-token activation scales)."""
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(d) >= (9, 0)


def on_device(
    s: StoredScheme, device: torch.device | str, fp8_gemm: bool | None = None
) -> StoredScheme:
    """s as the device that runs the model takes it: fp8 weights dequantized at load where
    the device has no fp8 matmul; where it has a rowwise one (fp8_gemm; None: ask the device),
    fp8 weights with dynamic per-token fp8 activations (FP8_DYNAMIC) run as fp8 x fp8 GEMMs.
    Static input scales and 128x128 blocks keep the weight-only Float8Tensor."""
    dev = torch.device(device)
    if s.weights != "fp8" or s.transformers:  # transformers' load decompresses it anywhere
        return s
    if dev.type not in _FP8_MATMUL:
        return replace(s, dequantized=True)
    gemm = fp8_gemm_capable(dev) if fp8_gemm is None else fp8_gemm
    if gemm and s.act == "dynamic" and s.block is None:
        return replace(s, fp8_gemm=True)
    return s


def dequantize_rows(q: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored (out, in) weight (fp8, int8; INT4's q - z) times its (out, k) scale rows,
    each scale over a run of in / k columns: in float32, as torchao dequantizes, then cast."""
    out, n_in = q.shape
    k = rows.shape[1]
    w = q.to(torch.float32).view(out, k, n_in // k)
    w.mul_(rows.to(device=w.device, dtype=torch.float32).unsqueeze(-1))
    return w.view(out, n_in).to(dtype)


def _in_moe(cfg: ModelConfig, name: str) -> bool:
    slot = weight_slot(cfg, name)
    return slot is not None and is_moe_param(slot.name)


def moe_dequantized(
    tensors: Iterable[tuple[str, Any, Path]],
    cfg: ModelConfig,
    s: StoredScheme,
    dtype: torch.dtype,
    whole: WholeReads,
) -> Iterator[tuple[str, Any, Path]]:
    """The checkpoint's tensors (after int4_tensors.unpacked) with each stored expert (or
    router) weight and its scale replaced by the dequantized weight, once both are read;
    whole: the load's reader of tensors converted at once (read whole, not through the
    file's map)."""
    if not cfg.n_experts:
        yield from tensors
        return
    suffix = f".{s.scale_suffix}"
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor, file in tensors:
        is_scale = name.endswith(suffix)
        prefix = name.removesuffix(suffix if is_scale else ".weight")
        if not (is_scale or name.endswith(".weight")) or not _in_moe(cfg, prefix + ".weight"):
            yield name, tensor, file
            continue
        if not is_scale and stored_dtype(tensor) is None:  # a float expert (act-order INT4)
            yield name, tensor, file
            continue
        with reading(file):
            t = tensor if isinstance(tensor, torch.Tensor) else whole.read(file, name, tensor)
        parts = pending.setdefault(prefix, {})
        parts["scale" if is_scale else "weight"] = t
        if len(parts) == 2:
            q, scale = parts["weight"], pending.pop(prefix)["scale"]
            rows = scale_rows(scale, (q.shape[0], q.shape[1]), s)
            yield f"{prefix}.weight", dequantize_rows(q, rows, dtype), file
    if pending:
        prefix, parts = next(iter(pending.items()))
        lacks = "scale" if "weight" in parts else "weight"
        raise ModelLoadError(
            f"the checkpoint's MoE expert {prefix} has no stored {lacks} ({s.source} stores "
            f"a weight and its {s.scale_suffix} for each); the checkpoint and its "
            "quantization_config disagree"
        )


def check_experts(cfg: ModelConfig, s: StoredScheme, path: Path) -> None:
    """ModelLoadError, before any weight is read, for a MoE model stored as s in a layout
    this module does not dequantize: experts stored 3-D, or with quantized inputs."""
    if not cfg.n_experts:
        return
    if s.act is not None:
        raise ModelLoadError(
            f"{path}: a MoE model's experts stored as {s.source} with quantized inputs "
            f"({s.activations}) are not loaded: batchgen dequantizes experts at load and "
            f"would run them on inputs in the model dtype; {_FIX}"
        )
    stacked = [n for n in quantized_tensors(path) if _STACKED.search(n)]
    if stacked:
        raise ModelLoadError(
            f"{path}: a MoE model's experts stored 3-D as {s.source} ({stacked[0]}) are not "
            "loaded; batchgen loads a quantized linear per expert (experts.<e>.gate_proj, "
            f"...); {_FIX}"
        )


def note(s: StoredScheme, moe: bool, dtype: torch.dtype | str, nbytes: int, device: str) -> str:
    """The one line that says what of s is dequantized at load and why, and the bytes the
    weights take (nbytes); "" where nothing is."""
    dtype, size = str(dtype).removeprefix("torch."), format_bytes(nbytes)
    if s.transformers:
        what = f"transformers decompresses the stored weights at load to {dtype}"
    elif s.dequantized:
        what = f"{device} has no fp8 matmul, so the fp8 weights are dequantized at load to {dtype}"
    elif moe:
        what = (
            f"no grouped {s.weights} expert kernel here, so the MoE experts are dequantized at "
            f"load to {dtype} (the other linears stay {s.weights})"
        )
    else:
        return ""
    return f"{s.source}: {what}: the weights take {size}"
