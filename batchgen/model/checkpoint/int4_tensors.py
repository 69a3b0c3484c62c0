"""INT4 checkpoints' tensors (int4_formats.py says how each format packs them) turned, as they
are read, into what the loader already places: per linear layer, `<module>.weight` holding
q - z as int8 (out, in), and `<module>.weight_scale` (out, groups), float32. The loader then
fuses and splits them as it does W8A16's int8 weights and group scales (a tensor-parallel rank
takes its rows, or the groups of its columns), and `int4_weight` packs each into the
torchao tensor that runs it.

Kept at 4 bits where a kernel takes it: on the CPU, torchao's Int4OpaqueTensor (tinygemm's CPU
kernel, `--quantize int4`'s tensor), for groups of 32, 64, 128 or 256 input columns. Its
kernel computes (q' - 8) * s + m per group with a float m, so q - z is shifted into 0..15 per
group (q' = q - z + c, m = (8 - c) * s): the same weight, to float rounding. Elsewhere (a
GPU, another group size) the layer is kept as torchao's Int8Tensor of q - z with its group
scales: exact, a byte a weight; said in one log line. Act-order GPTQ (g_idx out of order,
so a group is not a run of columns) is dequantized at load to the model dtype, in one line.

Memory: a layer's packed tensors are read whole (a tensor-parallel rank too), with plain
reads, not through the file's memory map (files.WholeReads: their pages would stay resident),
and unpacked to int8 as soon as the last is read; the loader packs each linear as soon as its
rows are all placed (model/checkpoint/stored_linears.py), so one layer at a time is held at a
byte a weight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.files import WholeReads, reading
from batchgen.model.checkpoint.int4_formats import AWQ_ORDER, Int4Layout
from batchgen.model.quiet_import import quiet_torchao

log = logging.getLogger(__name__)

TINYGEMM_GROUPS = (256, 128, 64, 32)  # the group sizes the CPU int4 kernel takes
_PACK_WEIGHTS = 1 << 20  # weights packed for the CPU kernel at a time
_AWQ_UNDO = [AWQ_ORDER.index(i) for i in range(8)]  # column j sits in nibble _AWQ_UNDO[j]


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """(..., n) int32 words -> (..., 8n) int8, their 4-bit values 0..15, the lowest nibble
    first; one nibble of every word at a time, so no int32 copy of all the values is made."""
    out = torch.empty((*words.shape, 8), dtype=torch.int8, device=words.device)
    for k in range(8):
        out[..., k] = (words >> (4 * k)) & 0xF
    return out.reshape(*words.shape[:-1], -1)


def _int(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise ModelLoadError(f"the checkpoint's {name} is {t.dtype}, not int32 packed words")
    return t


def _q_z_scale(layout: Int4Layout, p: dict[str, torch.Tensor], prefix: str):
    """(q (out, in), z (out, groups), s (out, groups) float32, g_idx (in,) or None)."""
    if layout.kind == "compressed-tensors":
        out, n_in = (int(x) for x in p["weight_shape"].tolist())
        q = nibbles(_int(p["weight_packed"], f"{prefix}.weight_packed"))[:, :n_in].sub_(8)
        s = p["weight_scale"].float().reshape(out, -1)
        z = torch.zeros(out, s.shape[1], dtype=q.dtype)
        if not layout.symmetric:  # packed along the output rows
            zp = _int(p["weight_zero_point"], f"{prefix}.weight_zero_point")
            z = nibbles(zp.t().contiguous())[:, :out].t() - 8
        return q, z, s, None
    s = p["scales"].float().t().contiguous()  # (groups, out) -> (out, groups)
    zeros = nibbles(_int(p["qzeros"], f"{prefix}.qzeros"))  # (groups, out)
    if layout.kind == "gptq":  # qweight (in/8, out): eight input rows a word
        q = nibbles(_int(p["qweight"], f"{prefix}.qweight").t().contiguous())  # (out, in)
        z = (zeros + layout.zero_offset).t()
        return q, z, s, p.get("g_idx")
    undo = torch.arange(zeros.shape[-1]).view(-1, 8)[:, _AWQ_UNDO].reshape(-1)
    q = nibbles(_int(p["qweight"], f"{prefix}.qweight"))[:, undo].t()  # (in, out) -> (out, in)
    return q, zeros[:, undo].t(), s, None


def _in_order(g_idx: torch.Tensor, width: int) -> bool:
    return torch.equal(g_idx.long(), torch.arange(len(g_idx)) // width)


def _check_in_order(g_idx: torch.Tensor, layout: Int4Layout, prefix: str) -> None:
    if not _in_order(g_idx, layout.group or len(g_idx)):
        raise ModelLoadError(
            f"the checkpoint's {prefix}.g_idx is out of order but its quantization_config "
            "says desc_act false; the checkpoint and its config disagree"
        )


def unpack_layer(
    layout: Int4Layout, p: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One layer's stored tensors p -> {`<prefix>.weight`: q - z int8 (out, in),
    `<prefix>.weight_scale`: (out, groups)}; or, for act-order, the dequantized weight alone."""
    q, z, s, g_idx = _q_z_scale(layout, p, prefix)
    out, n_in = q.shape
    width = layout.group or n_in
    if n_in % width or s.shape != (out, n_in // width) or z.shape[1] != s.shape[1]:
        raise ModelLoadError(
            f"the checkpoint's {prefix} is {out}x{n_in} with {tuple(s.shape)} scales, which "
            f"its quantization_config ({layout.source}, {layout.granularity}) does not describe"
        )
    if g_idx is not None and not _in_order(g_idx, width):  # act-order (else refused before)
        groups = g_idx.long()  # act-order: each column's own group
        w = (q - z[:, groups]).float() * s[:, groups]
        return {f"{prefix}.weight": w.to(dtype)}
    d = q.reshape(out, -1, width).sub_(z.unsqueeze(-1))  # int8, -15..15; q is this one's
    return {f"{prefix}.weight": d.reshape(out, n_in).contiguous(), f"{prefix}.weight_scale": s}


def unpacked(
    tensors: Iterable[tuple[str, Any, Path]], layout: Int4Layout | None, dtype: torch.dtype
) -> Iterator[tuple[str, Any, Path]]:
    """The checkpoint's tensors (loader.iter_tensors) with each INT4 layer's packed parts
    replaced by its unpacked weight and scales, once all of its parts are read."""
    if layout is None:
        yield from tensors
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    said = False
    whole = WholeReads()
    for name, tensor, file in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in layout.parts:
            yield name, tensor, file
            continue
        if part == "g_idx" and not layout.act_order:  # in order, as the config says
            with reading(file):
                _check_in_order(whole.read(file, name, tensor), layout, prefix)
            continue
        with reading(file):
            parts = pending.setdefault(prefix, {})
            parts[part] = whole.read(file, name, tensor)
        if all(r in parts for r in layout.required):
            done = unpack_layer(layout, pending.pop(prefix), prefix, dtype)
            if len(done) == 1 and not said:
                log.warning(
                    "%s: act-order groups (g_idx out of order) have no int4 kernel; those "
                    "layers are dequantized at load to %s",
                    layout.source,
                    str(dtype).removeprefix("torch."),
                )
                said = True
            for k, v in done.items():
                yield k, v, file
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = sorted(set(layout.required) - set(parts))
        raise ModelLoadError(
            f"the checkpoint's {prefix} lacks {', '.join(missing)} ({layout.source} stores "
            f"{', '.join(layout.required)} for each layer)"
        )


def int4_weight(d: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torchao weight of a layer's q - z (out, in) int8 and its (out, groups) scales:
    Int4OpaqueTensor where the CPU kernel takes it, else Int8Tensor (exact, a byte a weight)."""
    out, n_in = d.shape
    group = n_in // scale.shape[1]
    if scale.shape[1] == 1:  # per channel: any group size the kernel takes, scales repeated
        group = next((g for g in TINYGEMM_GROUPS if n_in % g == 0), n_in)
        scale = scale.expand(out, n_in // group).contiguous()
    with quiet_torchao():
        if d.device.type == "cpu" and group in TINYGEMM_GROUPS:
            from torchao.prototype.quantization.int4 import Int4OpaqueTensor
            from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

            groups = d.reshape(out, -1, group)
            c = -groups.amin(-1)  # (out, groups): q - z + c lies in 0..15
            # the kernel packs each row on its own, from int32: a block of rows at a time
            # keeps that copy at 4 MiB, not 4 bytes a weight of the whole layer
            packed = torch.empty((out, n_in // 2), dtype=torch.uint8)
            step = max(16, _PACK_WEIGHTS // n_in // 16 * 16)  # rows: a multiple of 16
            for r in range(0, out, step):
                rows = slice(r, r + step)
                q = (groups[rows] + c[rows].unsqueeze(-1)).reshape(-1, n_in).to(torch.int32)
                packed[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            zero = (8 - c).float() * scale
            sz = pack_tinygemm_scales_and_zeros(scale.to(dtype), zero.to(dtype), dtype)
            return Int4OpaqueTensor(packed, sz, [1, group], torch.Size((out, n_in)))
        from torchao.quantization import Int8Tensor

    return Int8Tensor(d, scale, block_size=[1, group], dtype=dtype)


def say_kept_as(weights: Iterable[torch.Tensor], layout: Int4Layout) -> None:
    """One log line where some INT4 layers are kept at int8, not at 4 bits."""
    wide = sum(type(w).__name__ == "Int8Tensor" for w in weights)
    if wide:
        log.warning(
            "%s: %d layers have no int4 kernel here (one runs on the CPU, for groups of "
            "32/64/128/256); they are kept as int8 q - z with their scales: exact, a byte a "
            "weight",
            layout.source,
            wide,
        )
