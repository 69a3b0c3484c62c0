"""Pre-quantized checkpoints written from a saved float one, for the tests of
batchgen/model/checkpoint/format.py and the formats batchgen loads.

`declare_format(src, dst, family)` writes, for each format family batchgen does not load, the
checkpoint's declaration (config.json's quantization_config, or ModelOpt's
hf_quant_config.json) and its quantized tensors' names and dtypes as that format stores them.
The values are not a real quantization of src: these checkpoints exist to be refused before
any weight is read. `compress(src, dst, scheme)` writes real compressed-tensors checkpoints
with compressed-tensors itself, for the formats batchgen loads.
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
    scheme = {"targets": ["Linear"], "weights": weights, "format": fmt}
    config = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
    }
    if fmt == "float-quantized":  # an fp8 KV cache: not loaded yet
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    return config


def _fp8(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": w.to(FP8), f"{name}.weight_scale": torch.ones(w.shape[0], 1)}


def _static_fp8(w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    return {**_fp8(w, name), f"{name}.input_scale": torch.ones(1)}


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
    "ct-fp8-kv-cache": (_ct("float-quantized", 8, "float", "channel"), None, _static_fp8),
    "ct-w3a16": (_ct("pack-quantized", 3, "int", "group", 32), None, _packed),
    "modelopt-nvfp4": (
        None,
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}},
        _static_fp8,
    ),
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32}, None, _gptq),
    "awq-gemv": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
        None,
        _gptq,
    ),
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


# compressed-tensors schemes as llm-compressor's presets write them (FP8_DYNAMIC, W8A8, W8A16),
# with groups of 16 where a preset has 128 (the tiny models are 32 and 64 wide)
FLOAT, INT = dict(num_bits=8, type="float"), dict(num_bits=8, type="int")
TOKEN = dict(strategy="token", dynamic=True)
# compressed-tensors would pack W8A16's int8 weights four to an int32 (pack-quantized, refused),
# so that one is written as int-quantized (int8 tensors); per-tensor FP8 is naive-quantized.
CT_SCHEMES = {
    "fp8-dynamic": dict(
        weights={**FLOAT, "strategy": "channel"}, input_activations={**FLOAT, **TOKEN}
    ),
    "fp8-tensor": dict(weights={**FLOAT, "strategy": "tensor"}),
    # the FP8 preset: per-tensor weights, a static per-tensor scale for each layer's input
    "fp8-static": dict(
        weights={**FLOAT, "strategy": "tensor"},
        input_activations={**FLOAT, "strategy": "tensor", "dynamic": False},
    ),
    "w8a8": dict(weights={**INT, "strategy": "channel"}, input_activations={**INT, **TOKEN}),
    "w8a16-group": dict(weights={**INT, "strategy": "group", "group_size": 16}),
}
# W4A16 (llm-compressor's preset, groups of 32 here), per channel, and with zero points;
# compressed-tensors writes them pack-quantized (tests/test_quant_int4.py)
INT4 = dict(num_bits=4, type="int")
CT_INT4 = {
    "w4a16-group": dict(weights={**INT4, "strategy": "group", "group_size": 32}),
    "w4a16-channel": dict(weights={**INT4, "strategy": "channel"}),
    "w4a16-asym": dict(weights={**INT4, "strategy": "group", "group_size": 32, "symmetric": False}),
}


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The observed range of w that args' scales cover (llm-compressor's min-max observer)."""
    if args.strategy == "tensor":
        return w.min().reshape(1), w.max().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    groups = w.view(w.shape[0], -1, args.group_size)
    return groups.amin(-1), groups.amax(-1)


def calibration_amax(model: torch.nn.Module, layers: list[torch.nn.Module]) -> dict:
    """Each layer's largest input magnitude over 4 rows of 16 random tokens of the float model
    (a min-max observer's range for a static input scale)."""
    amax = {}

    def observe(m, args):
        amax[m] = max(amax.get(m, 0.0), args[0].abs().max().item())

    hooks = [m.register_forward_pre_hook(observe) for m in layers]
    with torch.no_grad():
        model(torch.randint(2, 500, (4, 16), generator=torch.Generator().manual_seed(0)))
    for h in hooks:
        h.remove()
    return amax


def _calibrate_inputs(model, args, calculate_qparams) -> None:
    layers = [m for m in model.modules() if hasattr(m, "input_scale")]
    for m in layers:  # observed on the float model, as llm-compressor's calibration does
        m.quantization_enabled = False
    for m, amax in calibration_amax(model, layers).items():
        scale, _ = calculate_qparams(torch.tensor([-amax]), torch.tensor([amax]), args)
        m.input_scale.data.copy_(scale.reshape(m.input_scale.shape))
        m.quantization_enabled = True


def compress(src: Path, dst: Path, scheme: str) -> Path:
    """dst: src's checkpoint quantized and saved by compressed-tensors as `scheme` of
    CT_SCHEMES or CT_INT4 (weights' scales from their min and max, as llm-compressor's default
    observer sets them; lm_head left in float), loadable by transformers."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    group = QuantizationScheme(targets=["Linear"], **{**CT_SCHEMES, **CT_INT4}[scheme])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for m in model.modules():
            args = getattr(getattr(m, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            scale, zero = calculate_qparams(*_minmax(m.weight, args), args)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(zero.reshape(m.weight_zero_point.shape))
    fmt = "int-quantized" if scheme == "w8a16-group" else None  # None: compressed-tensors' pick
    if group.input_activations is not None and not group.input_activations.dynamic:
        _calibrate_inputs(model, group.input_activations, calculate_qparams)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for f in src.iterdir():  # tokenizer and generation config
        if not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


def block_fp8(src: Path, dst: Path, block: tuple[int, int] = (16, 32)) -> Path:
    """dst: src's checkpoint as fine-grained block FP8 (DeepSeek-V3, Qwen3-*-FP8:
    `quant_method: fp8`, `weight_block_size`), written as their conversion script writes it:
    each decoder linear's weight in fp8 e4m3 and, per block of rows x columns, its
    `weight_scale_inv` = the block's largest magnitude / 448 (what the weight is multiplied by
    to dequantize it). Blocks of 16 x 32 on the tiny models (128 x 128 in the real ones)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    br, bc = block
    for name in [n for n in tensors if n.endswith(tuple(f"{m}.weight" for m in LINEARS))]:
        w = tensors.pop(name)
        (out, n_in), rows, cols = w.shape, -(-w.shape[0] // br), -(-w.shape[1] // bc)
        padded = torch.zeros(rows * br, cols * bc)  # the last blocks may overhang the weight
        padded[:out, :n_in] = w
        blocks = padded.unflatten(0, (rows, br)).unflatten(-1, (cols, bc))
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(FP8).max  # (rows, cols)
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:out, :n_in]
        tensors[name] = (w / full).to(FP8)
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((dst / "config.json").read_text())
    hf["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def modelopt_fp8(src: Path, dst: Path) -> Path:
    """dst: src's checkpoint as NVIDIA ModelOpt exports FP8 (`hf_quant_config.json`,
    quant_algo FP8): each decoder linear's weight in fp8 e4m3 with a per-tensor `weight_scale`
    (its largest magnitude / 448) and a static per-tensor `input_scale` (its input's largest
    magnitude over a calibration batch / 448)."""
    import transformers

    shutil.copytree(src, dst)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layers = {n: m for n, m in model.named_modules() if n.endswith(LINEARS)}
    amax = calibration_amax(model, list(layers.values()))
    tensors = load_file(dst / "model.safetensors")
    fp8_max = torch.finfo(FP8).max
    for name, m in layers.items():
        w = tensors.pop(f"{name}.weight")
        scale = w.abs().max() / fp8_max
        tensors[f"{name}.weight"] = (w / scale).to(FP8)
        tensors[f"{name}.weight_scale"] = scale.reshape(())
        tensors[f"{name}.input_scale"] = torch.tensor(amax[m] / fp8_max)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    (dst / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant})
    )
    return dst


def modelopt_reference(src: Path, checkpoint: Path):
    """transformers' float model of src with checkpoint's ModelOpt FP8 weights dequantized
    and each linear's input quantized to fp8 with its static input_scale and back: the model
    the checkpoint describes (transformers does not load ModelOpt checkpoints on the CPU)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tensors = load_file(checkpoint / "model.safetensors")
    fp8_max = torch.finfo(FP8).max

    def quantize_input(scale):
        return lambda _m, args: (
            (args[0] / scale).clamp(-fp8_max, fp8_max).to(FP8).float() * scale,
        )

    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith(LINEARS):
                w, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
                m.weight.copy_(w.float() * s)
                m.register_forward_pre_hook(quantize_input(tensors[f"{name}.input_scale"]))
    return model.eval()
