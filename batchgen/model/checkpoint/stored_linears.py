"""A pre-quantized checkpoint's decoder linears, each made its torchao tensor
(prequantized.quantized_weight), or dequantized where no kernel takes it (fp8 on the CPU:
dequantized.py), as soon as the loader has placed all of its rows and all of their scale
rows, and its stored rows dropped then. Packing them after the last was read held
every linear in its stored form until the end: for INT4, unpacked to int8 q - z, a byte a
weight, twice the packed size, and the peak RSS of a load was 1.8-2.2x the weights
(docs/quantization.md); now one layer at a time is held so, and the heap's free pages are
handed back after each INT4 layer (host_malloc.trim: the transients lie among the packed
layers kept, and stayed resident, 10-60 MiB on a 100 MiB model).

A scale's rows follow its weight's (prequantized.scale_rows needs the weight's checkpoint
shape), so a scale read before its weight (in another file of a sharded checkpoint) waits for
it. Scales and stored weights that never pair up are refused at the end, in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.dequantized import dequantize_rows
from batchgen.model.checkpoint.files import reading, take
from batchgen.model.checkpoint.int4_tensors import say_kept_as
from batchgen.model.checkpoint.names import weight_slot
from batchgen.model.checkpoint.placing import Placing
from batchgen.model.checkpoint.prequantized import (
    SCALE,
    StoredScheme,
    quantized_weight,
    scale_copy,
    scale_rows,
)
from batchgen.model.config import ModelConfig
from batchgen.model.host_malloc import trim
from batchgen.model.parallel.sharding import TPShard

# the stored weights' dtypes; INT4 layers come unpacked to int8 q - z (int4_tensors.py)
_DTYPES = {"fp8": (torch.float8_e4m3fn,), "int8": (torch.int8,), "int4": (torch.int8,)}


class StoredLinears:
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPShard,
        s: StoredScheme,
        dtype: torch.dtype,
        device: torch.device,
        placing: Placing,
    ) -> None:
        self.cfg, self.tp, self.s, self.dtype, self.device = cfg, tp, s, dtype, device
        self.placing = placing
        self.shapes: dict[str, tuple[int, int]] = {}  # checkpoint shapes of stored weights
        self.waiting: dict[str, tuple[Any, Path]] = {}  # scales read before their weight
        self.packed: set[str] = set()  # our names of the weights made torchao tensors

    def weight(self, name: str, key: str, shape: list[int]) -> None:
        """The stored weight name (checkpoint) was placed into key (ours)."""
        self.shapes[name] = (shape[0], shape[1])
        if name in self.waiting:
            self.scale(name, *self.waiting.pop(name))
        self._pack(key)

    def scale(self, name: str, tensor: Any, file: Path) -> None:
        """The scale of the checkpoint's weight name was read."""
        slot = weight_slot(self.cfg, name, self.tp)
        if slot is None:
            return
        if name not in self.shapes:
            self.waiting[name] = (tensor, file)
            return
        with reading(file):
            rows = scale_rows(tensor[...], self.shapes[name], self.s).to(self.device)
        key = slot.name + SCALE
        p = self.placing
        p.shapes[key] = torch.Size((p.shapes[slot.name][0], rows.shape[1]))
        for c in slot.copies:
            p.put(name, key, c, take(rows, scale_copy(c, self.s), False))
        self._pack(slot.name)

    def _pack(self, key: str) -> None:
        p = self.placing
        if key in self.packed or not (p.complete(key) and p.complete(key + SCALE)):
            return
        w, rows = p.out.pop(key), p.out.pop(key + SCALE)
        if self.s.dequantized:  # no kernel for it on this device (dequantized.py)
            p.out[key] = dequantize_rows(w, rows, self.dtype)
        else:
            p.out[key] = quantized_weight(w, rows, self.dtype, self.s)
        del w, rows  # the stored rows, freed before the heap is trimmed
        self.packed.add(key)
        if self.s.weights == "int4" or self.s.dequantized:  # the transients, given back
            trim()

    def finish(self) -> set[str]:
        """The packed weights' names; ModelLoadError for a weight without a scale, or a scale
        without its weight."""
        s, out = self.s, self.placing.out
        if self.waiting:
            name = next(iter(self.waiting))
            raise ModelLoadError(
                f"the checkpoint has a scale for {name}, which is not stored as {s.source} "
                "weights are; the checkpoint and its quantization_config disagree"
            )
        scales = {k.removesuffix(SCALE) for k in out if k.endswith(SCALE)}
        stored = {
            k for k, v in out.items() if k not in self.packed and v.dtype in _DTYPES[s.weights]
        }
        if scales or stored:
            raise ModelLoadError(
                f"the checkpoint's {s.source} weights and scales do not pair up: weights without "
                f"a scale {sorted(stored - scales)[:3]}, scales without a stored weight "
                f"{sorted(scales - stored)[:3]}"
            )
        outside = sorted(k for k in self.packed if not k.startswith("layers."))
        if outside:
            raise ModelLoadError(
                f"the checkpoint stores {outside[0]} quantized; batchgen loads quantized decoder "
                "linears only (embeddings and lm_head in a float dtype)"
            )
        if s.int4 is not None:
            say_kept_as((out[k] for k in self.packed), s.int4)
        return self.packed
