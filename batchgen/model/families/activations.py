"""The MLP activations by their ModelConfig names, written as transformers computes them (a
token-exact decoder needs the same formula, not just the same function)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":  # GPT-2's gelu_new, written out as transformers does
        return (
            0.5
            * x
            * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        )
    if name == "gelu_pytorch_tanh":  # Gemma's: torch's tanh approximation, one fused kernel
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"unknown activation {name!r}")
