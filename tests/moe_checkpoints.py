"""Pre-quantized MoE checkpoints (Qwen3-MoE, Mixtral: one linear per expert, as the hub's and
transformers' save_pretrained name them), each with the float model it describes (its stored
weights dequantized) for a reference transformers runs. INT4 GPTQ and AWQ come from
int4_checkpoints.write_int4; written here by hand, as their formats store them:

- compressed-tensors `pack-quantized` W4A16, symmetric, groups of 32: q = round(w / s) in
  -8..7 (s = max|w| / 7.5 a group, compressed-tensors' symmetric range), stored + 8, eight a
  word along the input columns (`weight_packed` (out, in/8)), `weight_scale` (out, groups),
  `weight_shape`;
- compressed-tensors `float-quantized` FP8 weights per channel, no input quantization:
  `weight` fp8 e4m3 = w / s, `weight_scale` (out, 1) = max|w| / 448 a row;
- block FP8 (`quant_method: fp8`, quant_checkpoints.block_fp8), dequantized here.

Routers are left in float, as GPTQModel, AutoAWQ and llm-compressor's MoE recipes leave them
(`ignore: ["re:.*mlp.gate$"]`); `router=True` quantizes them too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from int4_checkpoints import pack_words, write_int4
from quant_checkpoints import FP8, LINEARS, block_fp8
from safetensors.torch import load_file, save_file

MIXTRAL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3")
ROUTERS = ("mlp.gate", "block_sparse_moe.gate")


def _ct_config(weights: dict, fmt: str) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "format": fmt}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }


def _ct_w4a16(w: torch.Tensor, name: str) -> tuple[dict, torch.Tensor]:
    out, n_in = w.shape
    groups = w.reshape(out, -1, 32)
    s = (groups.abs().amax(-1, keepdim=True) / 7.5).clamp(min=1e-6)
    q = torch.round(groups / s).clamp(-8, 7)
    stored = {
        f"{name}.weight_packed": pack_words((q + 8).reshape(out, n_in)),
        f"{name}.weight_scale": s.squeeze(-1).contiguous(),
        f"{name}.weight_shape": torch.tensor([out, n_in]),
    }
    return stored, (q * s).reshape(out, n_in)


def _ct_fp8(w: torch.Tensor, name: str) -> tuple[dict, torch.Tensor]:
    s = w.abs().amax(-1, keepdim=True).clamp(min=1e-6) / torch.finfo(FP8).max
    q = (w / s).to(FP8)
    return {f"{name}.weight": q, f"{name}.weight_scale": s}, q.float() * s


CT = {
    "ct-w4a16": (
        _ct_w4a16,
        _ct_config(
            {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}, "pack-quantized"
        ),
    ),
    "ct-fp8": (
        _ct_fp8,
        _ct_config({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized"),
    ),
}


def _write(src: Path, dst: Path, tensors: dict, reference: dict, config: dict) -> tuple[Path, Path]:
    shutil.copytree(src, dst)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    ref = dst.with_name(dst.name + "-reference")
    shutil.copytree(src, ref)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return dst, ref


def write_ct(src: Path, dst: Path, fmt: str, linears: tuple[str, ...]) -> tuple[Path, Path]:
    """(dst: src's checkpoint with the linears named in linears stored as fmt of CT,
    dst-reference: the float model it describes)."""
    store, config = CT[fmt]
    tensors = load_file(src / "model.safetensors")
    reference = dict(tensors)
    for name in [n for n in tensors if n.endswith(tuple(f".{m}.weight" for m in linears))]:
        stored, reference[name] = store(tensors.pop(name).float(), name.removesuffix(".weight"))
        tensors.update(stored)
    return _write(src, dst, tensors, reference, config)


def block_fp8_with_reference(src: Path, dst: Path) -> tuple[Path, Path]:
    """(quant_checkpoints.block_fp8 of src, in blocks of 16 x 32, and its dequantized model)."""
    block_fp8(src, dst)
    tensors = load_file(dst / "model.safetensors")
    reference = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        w = tensors[name.removesuffix("_scale_inv")]
        s = tensors[name].repeat_interleave(16, 0).repeat_interleave(32, 1)
        reference[name.removesuffix("_scale_inv")] = w.float() * s[: w.shape[0], : w.shape[1]]
    ref = dst.with_name(dst.name + "-reference")
    shutil.copytree(src, ref)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return dst, ref


def write_moe(src: Path, dst: Path, family: str, fmt: str, router: bool = False):
    """(dst: the MoE checkpoint src (family: qwen3_moe or mixtral) stored as fmt: gptq, awq,
    ct-w4a16, ct-fp8 or block-fp8 (qwen3_moe only); dst-reference: the model it describes)."""
    linears = MIXTRAL_LINEARS if family == "mixtral" else LINEARS
    linears += ROUTERS if router else ()
    if fmt in ("gptq", "awq"):
        return write_int4(src, dst, fmt, group=32, sym=fmt == "gptq", linears=linears)
    if fmt == "block-fp8":
        return block_fp8_with_reference(src, dst)
    return write_ct(src, dst, fmt, linears)


def stack_experts(src: Path, dst: Path) -> Path:
    """dst: the Qwen3-MoE checkpoint src with its experts stored 3-D, in fp8 with a scale per
    expert (`experts.gate_up_proj` (E, 2I, dim), `experts.down_proj` (E, dim, I)), declared
    as block FP8: a layout batchgen refuses."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    layers = {n.split(".experts.")[0] for n in tensors if ".experts." in n}
    for layer in sorted(layers):
        experts = sorted(
            {int(n.split(".")[5]) for n in tensors if n.startswith(layer + ".experts.")}
        )

        def pop(e: int, m: str, layer: str = layer) -> torch.Tensor:
            return tensors.pop(f"{layer}.experts.{e}.{m}.weight")

        gate_up = torch.stack(
            [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in experts]
        )
        down = torch.stack([pop(e, "down_proj") for e in experts])
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            tensors[f"{layer}.experts.{name}"] = w.to(FP8)
            tensors[f"{layer}.experts.{name}_scale_inv"] = torch.ones(len(experts))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((dst / "config.json").read_text())
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    hf["quantization_config"] = {**q, "weight_block_size": [16, 32]}
    (dst / "config.json").write_text(json.dumps(hf))
    return dst
