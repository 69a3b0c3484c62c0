"""The state dict the loader fills (model/checkpoint/loader.py): whole tensors, and the rows of
fused matrices (q, k, v -> wqkv; gate, up -> w_in) counted as they are copied in, so that a
matrix is known complete as soon as its last rows are (a stored linear is packed then:
stored_linears.py), and one left incomplete is named at the end."""

from __future__ import annotations

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.parallel.sharding import Copy


class Placing:
    def __init__(self, shapes: dict[str, torch.Size]) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.shapes = dict(shapes)  # the local parameters' shapes, and scale rows' as read
        self.filled: dict[str, int] = {}  # elements written into each fused matrix so far

    def put(self, name: str, key: str, c: Copy, t: torch.Tensor) -> None:
        """t (checkpoint tensor name's slice c) into out[key], whole or into rows c.dst."""
        out = self.out
        if c.dst is None:
            out[key] = t
            return
        if key not in out:
            out[key] = torch.empty(self.shapes[key], device=t.device, dtype=t.dtype)
        want = out[key][c.dst].shape
        if t.shape != want or t.dtype != out[key].dtype:
            raise ModelLoadError(
                f"the checkpoint's {name} does not match its config.json (size mismatch: "
                f"{tuple(t.shape)} {t.dtype} read, {tuple(want)} {out[key].dtype} expected for "
                f"{key}); the weights and config.json must come from the same model"
            )
        out[key][c.dst].copy_(t)
        self.filled[key] = self.filled.get(key, 0) + t.numel()

    def complete(self, key: str) -> bool:
        """out[key] is placed whole (a fused matrix: all of its rows)."""
        if key not in self.out:
            return False
        return key not in self.filled or self.filled[key] == self.shapes[key].numel()

    def missing(self) -> list[str]:
        """The fused matrices some of whose rows were never read."""
        return sorted(k for k, n in self.filled.items() if n != self.shapes[k].numel())
