"""Stored weights that no kernel here takes, dequantized at load into the model dtype, each as
soon as it and its scale are placed, so no float copy of the model is made beside the stored
one (the issue's rule: kept quantized where a kernel runs them, dequantized at load where none
does, said in one line).

FP8 on a device with no fp8 matmul (the CPU; `on_device`). torchao's `Float8Tensor` there
dequantizes its weight at every call: a 334 M Llama decoded at 0.13x bf16's rate
(docs/quantization.md). Each fp8 linear is dequantized once instead, when its rows and scale
rows are all placed (stored_linears.py): w = q * scale in float32, then cast, as torchao
computes it at each call, so the numbers are the same. A checkpoint's input quantization
(activation_quant.py) still runs. On CUDA the weights stay `Float8Tensor`s.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from batchgen.model.checkpoint.prequantized import StoredScheme
from batchgen.model.memory import format_bytes

_FP8_MATMUL = ("cuda",)  # device types where stored fp8 weights stay Float8Tensors


def on_device(s: StoredScheme, device: torch.device | str) -> StoredScheme:
    """s as the device that runs the model takes it: fp8 weights dequantized at load where
    the device has no fp8 matmul."""
    if s.weights == "fp8" and torch.device(device).type not in _FP8_MATMUL:
        return replace(s, dequantized=True)
    return s


def dequantize_rows(q: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored (out, in) weight (fp8, int8; INT4's q - z) times its (out, k) scale rows,
    each scale over a run of in / k columns: in float32, as torchao dequantizes, then cast."""
    out, n_in = q.shape
    k = rows.shape[1]
    w = q.to(torch.float32).view(out, k, n_in // k)
    w.mul_(rows.to(device=w.device, dtype=torch.float32).unsqueeze(-1))
    return w.view(out, n_in).to(dtype)


def note(s: StoredScheme, dtype: torch.dtype | str, nbytes: int, device: str) -> str:
    """The one line that says what of s is dequantized at load and why, and the bytes the
    weights take (nbytes); "" where nothing is."""
    dtype, size = str(dtype).removeprefix("torch."), format_bytes(nbytes)
    if s.dequantized:
        what = f"{device} has no fp8 matmul, so the fp8 weights are dequantized at load to {dtype}"
    else:
        return ""
    return f"{s.source}: {what}: the weights take {size}"
