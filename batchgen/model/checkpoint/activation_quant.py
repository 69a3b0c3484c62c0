"""A pre-quantized checkpoint's input quantization (W8A8: fp8 or int8 activations, a scale
per token computed on the fly, or one static scale per layer from the checkpoint), applied
as the checkpoint's own format computes it on the CPU: quantize then dequantize each token's
input to a layer (compressed-tensors' `fake_quantize`, which transformers runs), before the
layer's matmul with its stored weight. Without it the
model differs from the checkpoint's (logits 2% apart on a tiny Llama): not a faster kernel,
the same numbers.

Per token: scale = max(|x|) / q_max over the token's features (q_max 448 for fp8 e4m3, and
127.5 for int8, whose range -128..127 compressed-tensors centres), a zero scale replaced by
the float32 epsilon; then x / scale is rounded (int8) or cast (fp8) within the range, and
multiplied back. With tensor parallelism a row-parallel layer (wo, w_out) sees its rank's
features only, so its scale is that slice's maximum, as in vLLM.
"""

from __future__ import annotations

import torch
from torch import nn

_RANGE = {"fp8": (-448.0, 448.0, 448.0), "int8": (-128.0, 127.0, 127.5)}


class TokenQuant(nn.Module):
    """Quantize-dequantize of a linear layer's input (a forward pre-hook): one scale per token,
    or the checkpoint's one static scale (a buffer) where given."""

    def __init__(self, kind: str, static: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.q_min, self.q_max, self.half_range = _RANGE[kind]
        self.register_buffer("static", static)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.static.to(x.dtype) if self.static is not None else self._per_token(x)
        scaled = (x / scale).clamp(self.q_min, self.q_max)
        fp8 = self.kind == "fp8"
        q = scaled.to(torch.float8_e4m3fn).to(x.dtype) if fp8 else scaled.round()
        return (q * scale).to(x.dtype)

    def _per_token(self, x: torch.Tensor) -> torch.Tensor:
        # (..., features): one scale per row of features
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        lo = torch.minimum(x.amin(-1, keepdim=True), zero)
        hi = torch.maximum(x.amax(-1, keepdim=True), zero)
        scale = torch.maximum(lo.abs(), hi) / self.half_range
        eps = torch.finfo(scale.dtype).eps
        return torch.where(scale == 0, torch.full_like(scale, eps), scale)

    def hook(self, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        return (self(args[0]),)


def quantize_inputs(
    model: nn.Module, layers: list[str], kind: str, static: dict[str, torch.Tensor] | None = None
) -> None:
    """Each linear module of model named in layers quantizes its input (kind: fp8 or int8) per
    token, or with static[name], its static scale; the quantizer is a child module
    `input_quant`, so it moves and prints with the layer."""
    for name in layers:
        linear = model.get_submodule(name)
        linear.input_quant = TokenQuant(kind, None if static is None else static[name])
        linear.register_forward_pre_hook(linear.input_quant.hook)
