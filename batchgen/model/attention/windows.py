"""Which keys a query sees besides the causal rule: a sliding window, or chunked attention.

Both travel as one int, `window`, through the masks and the decode ops: > 0 a sliding window
of that many positions (Mistral, Gemma's local layers), < 0 chunked attention (Llama 4's
local layers: the keys of the query's own chunk of -window positions), None every earlier key.
"""

from __future__ import annotations

import torch


def first_key(q_pos: torch.Tensor, window: int | None) -> torch.Tensor | int:
    """The first key position a query at q_pos sees. window: a sliding window of that many
    positions (> 0; Mistral's), or chunked attention (< 0; Llama 4's: the keys of the query's
    own chunk of -window positions, [q_pos // C * C, q_pos]), or None (every earlier key)."""
    if window is None:
        return 0
    if window < 0:
        return q_pos // -window * -window
    return q_pos - window + 1


def window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    if window is None:
        return torch.ones_like(k_pos, dtype=torch.bool)
    return k_pos >= first_key(q_pos, window)
