"""A step's inputs onto the device in one copy.

Every array of a `StepInputs` (tokens, positions, cache slots, the LM head's rows, the decode
groups' block tables and lengths, the prefill spans' blocks) is written into one int64 staging
buffer, each at an offset aligned to 8 elements, and the buffer goes to the device in one
`non_blocking` copy into a device buffer kept from step to step (nano-vllm's `graph_vars`,
vLLM v1's persistent input batch); the model reads views of it. On a GPU the staging buffer
is pinned host memory, reused every step once the copy that last read it has completed (an
event), so the copy is a true asynchronous DMA and the host never waits on it. On the CPU the
device is the host: the staging array itself is the input (no copy).

Both buffers grow (doubling) when a step needs more; the warm-up's largest steps size them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.step_inputs import StepInputs

ALIGN = 8  # elements: every segment starts 64 bytes in


@dataclass(slots=True)
class DeviceInputs:
    """A step's inputs on the device: views of one buffer, in StepInputs' shapes."""

    tokens: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,)
    slots: torch.Tensor  # (T,)
    logits_index: torch.Tensor  # (S,)
    decodes: list[tuple[int, torch.Tensor, torch.Tensor]]  # (first token, (B, n), (B,))
    prefills: list[tuple[int, int, int, torch.Tensor | None]]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class InputBuffer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None  # pinned staging (CUDA)
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    def upload(self, x: StepInputs) -> DeviceInputs:
        parts = [x.tokens, x.positions, x.slots, x.logits_index]
        for _, tables, lens in x.decodes:
            parts += [tables.reshape(-1), lens]
        parts += [b for *_, b in x.prefills if b is not None]
        offsets, total = [], 0
        for p in parts:
            offsets.append(total)
            total += _aligned(len(p))
        stage = self._staging(total)
        for p, o in zip(parts, offsets, strict=True):
            stage[o : o + len(p)] = p
        base = self._to_device(stage, total)
        views = iter(base[o : o + len(p)] for p, o in zip(parts, offsets, strict=True))
        tokens, positions, slots, index = (next(views) for _ in range(4))
        decodes = [(q, next(views).view(tables.shape), next(views)) for q, tables, _ in x.decodes]
        prefills = [(q, n, c, None if b is None else next(views)) for q, n, c, b in x.prefills]
        return DeviceInputs(tokens, positions, slots, index, decodes, prefills)

    def _staging(self, total: int) -> np.ndarray:
        if not self.cuda:  # the CPU reads the staging array itself: a fresh one each step
            return np.empty(total, dtype=np.int64)
        if self._host is None or self._host.numel() < total:
            size = max(total, 2 * (self._host.numel() if self._host is not None else 0))
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)
            self._copied = None
        elif self._copied is not None:
            self._copied.synchronize()  # the last copy has read it (done long ago, mostly)
        return self._host.numpy()

    def _to_device(self, stage: np.ndarray, total: int) -> torch.Tensor:
        if not self.cuda:
            return torch.from_numpy(stage)
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._dev
