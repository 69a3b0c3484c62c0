"""Pre-quantized checkpoints written from a saved float one, for the tests of
batchgen/quant/checkpoint_format.py and the formats batchgen loads.

`declare_format(src, dst, family)` writes, for each format family users download, the
checkpoint's declaration (config.json's quantization_config, or ModelOpt's
hf_quant_config.json) and its quantized tensors' names and dtypes as that format stores them.
The values are not a real quantization of src: these checkpoints exist to be refused before
any weight is read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn


def _ct(fmt: str, bits: int, kind: str, strategy: str, group: int | None = None) -> dict:
    weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": True}
    if group:
        weights["group_size"] = group
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt}},
        "ignore": ["lm_head"],
    }


def _fp8(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": w.to(FP8), f"{name}.weight_scale": torch.ones(w.shape[0], 1)}


def _int8(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    q = w.clamp(-1, 1).mul(127).round().to(torch.int8)
    return {f"{name}.weight": q, f"{name}.weight_scale": torch.ones(w.shape[0], 1)}


def _packed(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    out, n_in = w.shape
    return {
        f"{name}.weight_packed": torch.zeros(out, n_in // 8, dtype=torch.int32),
        f"{name}.weight_scale": torch.ones(out, n_in // 32),
        f"{name}.weight_shape": torch.tensor([out, n_in]),
    }


def _block_fp8(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    return {f"{name}.weight": w.to(FP8), f"{name}.weight_scale_inv": torch.ones(blocks)}


def _modelopt(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    return {**_fp8(w, name), f"{name}.input_scale": torch.ones(())}


def _gptq(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    out, n_in = w.shape
    return {
        f"{name}.qweight": torch.zeros(n_in // 8, out, dtype=torch.int32),
        f"{name}.qzeros": torch.zeros(n_in // 32, out // 8, dtype=torch.int32),
        f"{name}.scales": torch.ones(n_in // 32, out, dtype=torch.float16),
        f"{name}.g_idx": torch.arange(n_in, dtype=torch.int32) // 32,
    }


def _bnb(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    return {**_int8(w, name), f"{name}.SCB": torch.ones(w.shape[0])}


# family -> (quantization_config in config.json, or None; hf_quant_config.json, or None;
# how one linear's weight is stored)
FORMATS = {
    "ct-fp8": (_ct("float-quantized", 8, "float", "channel"), None, _fp8),
    "ct-int8": (_ct("int-quantized", 8, "int", "channel"), None, _int8),
    "ct-w4a16": (_ct("pack-quantized", 4, "int", "group", 32), None, _packed),
    "block-fp8": (
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        None,
        _block_fp8,
    ),
    "modelopt-fp8": (
        None,
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}},
        _modelopt,
    ),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, None, _gptq),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, None, _gptq),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, None, _bnb),
    "undeclared-fp8": (None, None, _fp8),
}


def declare_format(src: Path, dst: Path, family: str) -> Path:
    """dst: src's checkpoint with every decoder linear stored as `family` of FORMATS stores it,
    declared as that format declares itself."""
    config, modelopt, store = FORMATS[family]
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(tuple(f"{m}.weight" for m in LINEARS))]:
        tensors.update(store(tensors.pop(name), name.removesuffix(".weight")))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        hf = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    if modelopt is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(modelopt))
    return dst
