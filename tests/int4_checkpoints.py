"""INT4 checkpoints written by hand from a saved float one, as GPTQ and AWQ write them, with
the float model each describes (its dequantized weights) for a reference transformers runs.

GPTQ, as AutoGPTQ's QuantLinear.pack writes it: `qweight` (in/8, out) int32, input row 8r + k
in bits 4k..4k+3 of word r; `qzeros` (groups, out/8), output column 8c + k in nibble k, each
zero point stored minus 1 (v1; `checkpoint_format: gptq_v2` stores it as is); `scales`
(groups, out) fp16; `g_idx` (in,) each input column's group. Act-order (desc_act) forms the
groups over the columns in a permuted order, so g_idx is not monotonic. The grid is GPTQ's
quantizer's, round to nearest (the tokens compare the format, not GPTQ's error feedback):
symmetric z = 8, s = 2 max|w| / 15; asymmetric s = (max - min) / 15, z = round(-min / s).
An asymmetric zero of 0 is kept at 1 or more: v1 would store it as -1, which AutoGPTQ's
packing spreads over the word's other nibbles (the reason GPTQModel wrote v2).

AWQ GEMM, as AutoAWQ writes it: `qweight` (in, out/8) and `qzeros` (groups, out/8) packed
along the output columns, nibble i of word c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i];
`scales` (groups, out) fp16; asymmetric grid, z unshifted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from quant_checkpoints import LINEARS
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """(..., 8n) values 0..15 -> (..., n) int32 words, value k of a word in bits 4k..4k+3."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = (v << (4 * torch.arange(8))).sum(-1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # as int32 bit patterns


def _grid(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale fp16, zero) of each row of w (rows: (out, group) columns of one group)."""
    if sym:
        scale = (2 * w.abs().amax(-1) / 15).clamp(min=1e-5).half()
        return scale, torch.full_like(scale, 8, dtype=torch.int64)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()
    zero = torch.round(-lo / scale.float()).clamp(1, 15).to(torch.int64)
    return scale, zero


def quantize(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None = None):
    """w (out, in) -> (q (out, in) 0..15, scale (groups, out) fp16, zero (groups, out),
    g_idx (in,)): groups of `group` columns taken in perm's order (act-order) or in order."""
    out, n_in = w.shape
    perm = torch.arange(n_in) if perm is None else perm
    g_idx = torch.empty(n_in, dtype=torch.int64)
    g_idx[perm] = torch.arange(n_in) // group
    scale, zero = _grid(w[:, perm].reshape(out, -1, group), sym)  # (out, groups)
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = (torch.round(w / s) + z).clamp(0, 15).to(torch.int64)
    return q, scale.t().contiguous(), zero.t().contiguous(), g_idx


def dequantized(q, scale, zero, g_idx) -> torch.Tensor:
    """The (out, in) float32 weight the format means: (q - z[g]) * s[g]."""
    return (q - zero.t()[:, g_idx]).float() * scale.float().t()[:, g_idx]


def _gptq_layer(name, w, group, sym, act_order, v2, g):
    group = group if group > 0 else w.shape[1]  # -1: one group a row
    perm = torch.randperm(w.shape[1], generator=g) if act_order else None
    q, scale, zero, g_idx = quantize(w, group, sym, perm)
    tensors = {
        f"{name}.qweight": pack_words(q).t(),  # (in/8, out): eight input rows a word
        f"{name}.qzeros": pack_words(zero - (0 if v2 else 1)),
        f"{name}.scales": scale,
        f"{name}.g_idx": g_idx.to(torch.int32),
    }
    return {k: v.contiguous() for k, v in tensors.items()}, dequantized(q, scale, zero, g_idx)


def _awq_layer(name, w, group, sym, act_order, v2, g):
    q, scale, zero, g_idx = quantize(w, group, sym=False)
    order = torch.arange(w.shape[0]).view(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)
    tensors = {
        f"{name}.qweight": pack_words(q.t()[:, order]),
        f"{name}.qzeros": pack_words(zero[:, order]),
        f"{name}.scales": scale,
    }
    return tensors, dequantized(q, scale, zero, g_idx)


def write_int4(
    src: Path,
    dst: Path,
    method: str,
    group: int = 32,
    sym: bool = False,
    act_order: bool = False,
    v2: bool = False,
    linears: tuple[str, ...] = LINEARS,
) -> tuple[Path, Path]:
    """(dst: src's checkpoint with every decoder linear (a module named as one of linears)
    stored as method, "gptq" or "awq", declares it (group -1: one group a row, GPTQ's per
    channel); dst-reference: src with those weights dequantized, a float checkpoint)."""
    write = {"gptq": _gptq_layer, "awq": _awq_layer}[method]
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    reference = dict(tensors)
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(tuple(f".{m}.weight" for m in linears))]:
        prefix = name.removesuffix(".weight")
        stored, w = write(prefix, tensors.pop(name).float(), group, sym, act_order, v2, g)
        tensors.update(stored)
        reference[name] = w
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((dst / "config.json").read_text())
    if method == "gptq":
        config = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym}
        config |= {"desc_act": act_order, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    else:
        config = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
        config["zero_point"] = True
    (dst / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    ref = dst.with_name(dst.name + "-reference")
    shutil.copytree(src, ref)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return dst, ref


def with_config(src: Path, dst: Path, **changes) -> Path:
    """dst: src's checkpoint with its quantization_config changed (None: a key removed)."""
    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text())
    q = {**hf["quantization_config"], **changes}
    hf["quantization_config"] = {k: v for k, v in q.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def ct_reference(src: Path, checkpoint: Path, scheme: dict) -> Path:
    """checkpoint-reference: src with each pack-quantized linear of checkpoint decompressed by
    compressed-tensors itself (transformers 5 mis-sizes packed zero points on load: it
    re-initializes them, so it is no reference for the asymmetric scheme)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    args = QuantizationScheme(targets=["Linear"], **scheme)
    tensors = load_file(checkpoint / "model.safetensors")
    reference = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        prefix = name.removesuffix(".weight_packed")
        state = {
            k.removeprefix(prefix + "."): v
            for k, v in tensors.items()
            if k.startswith(prefix + ".")
        }
        reference[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(state, args)[
            "weight"
        ]
    ref = checkpoint.with_name(checkpoint.name + "-reference")
    shutil.copytree(src, ref)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return ref
