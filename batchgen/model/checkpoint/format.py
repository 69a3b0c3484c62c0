"""What a checkpoint's stored weights are, read before any weight is: config.json's
`quantization_config` (or compressed-tensors' older `compression_config`), ModelOpt's
`hf_quant_config.json`, and the safetensors headers' tensor names and dtypes.

A pre-quantized checkpoint that batchgen does not load as its format says is refused here, in
one line naming the format and what to do: read without its scales it would run as a wrong
model (compressed-tensors FP8 weights cast to float32 gave 0 of 8 rows equal to transformers',
issue 39). Tensors that look quantized (fp8 or integer weights, `weight_scale`, `qweight`, ...)
in a checkpoint whose config declares no format are refused the same way: the scheme is read
from the checkpoint's own description, never guessed (docs/quantization.md).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.files import safetensors_header
from batchgen.model.checkpoint.prequantized import StoredScheme, stored_scheme

FIX = (
    "use the model's unquantized (bf16/fp16/fp32) release, with --quantize int8|int4|fp8 to "
    "quantize it at load"
)
# Tensor names that only quantized checkpoints carry (compressed-tensors, GPTQ, AWQ, block FP8,
# ModelOpt, bitsandbytes, MXFP4), and the dtypes a float checkpoint's weights never have.
QUANT_SUFFIXES = tuple(
    f".{n}"
    for n in (
        "weight_scale",
        "weight_scale_inv",
        "weight_scale_2",
        "weight_zero_point",
        "weight_global_scale",
        "weight_packed",
        "weight_shape",
        "input_scale",
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "SCB",
        "absmax",
        "quant_map",
    )
)
QUANT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I8", "U8", "I32", "I16"})


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """A checkpoint's declared quantization: its method and what it says of its tensors."""

    method: str  # quant_method: "compressed-tensors", "fp8", "modelopt", "gptq", ...
    description: str  # for messages: "compressed-tensors float-quantized (8-bit float weights)"
    config: dict[str, Any]  # the quantization_config (or hf_quant_config.json's) as written


def _compressed_tensors(q: dict) -> str:
    groups = q.get("config_groups") or {}
    formats = {g.get("format") for g in groups.values() if isinstance(g, dict)} | {q.get("format")}
    weights = []
    for g in groups.values():
        w = (g or {}).get("weights") or {}
        if w:
            strategy = w.get("strategy") or "tensor"
            weights.append(f"{w.get('num_bits')}-bit {w.get('type')} weights, per {strategy}")
    fmt = "/".join(sorted(f for f in formats if f)) or "unknown format"
    return f"compressed-tensors {fmt}" + (
        f" ({'; '.join(sorted(set(weights)))})" if weights else ""
    )


def describe(q: dict) -> str:
    """A quantization_config in words: its method and what it stores."""
    method = str(q.get("quant_method", "unknown"))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        block = q.get("weight_block_size")
        return f"fp8 (blocks of {block})" if block else "fp8 (per-tensor scales)"
    if method == "gptq":
        fmt = q.get("checkpoint_format", "gptq")
        order = ", desc_act" if q.get("desc_act") else ""
        return f"gptq ({q.get('bits')}-bit, group {q.get('group_size')}, {fmt} format{order})"
    if method == "awq":
        return f"awq ({q.get('bits')}-bit, group {q.get('group_size')}, {q.get('version')})"
    if method == "modelopt":
        return f"modelopt ({q.get('quant_algo')})"
    return method


def read_checkpoint_quant(path: Path, hf: dict) -> CheckpointQuant | None:
    """The quantization path's checkpoint declares (hf: its config.json), or None (float)."""
    q = hf.get("quantization_config") or hf.get("compression_config")
    if q:
        if not isinstance(q, dict):
            raise ModelLoadError(
                f"{path / 'config.json'}: quantization_config is {type(q).__name__}, not an object"
            )
        return CheckpointQuant(str(q.get("quant_method", "unknown")), describe(q), q)
    modelopt = path / "hf_quant_config.json"
    if modelopt.is_file():
        try:
            q = json.loads(modelopt.read_text()).get("quantization") or {}
        except (ValueError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {modelopt}: {e}") from None
        q = {"quant_method": "modelopt", **q}
        return CheckpointQuant("modelopt", describe(q), q)
    return None


def quantized_tensors(path: Path) -> list[str]:
    """`name (dtype)` of the tensors in path's safetensors files that only a quantized
    checkpoint has (a pickle has no header to read without loading it)."""
    found = []
    for f in sorted(path.glob("*.safetensors")):
        try:
            header = safetensors_header(f)
        except ModelLoadError:  # not a safetensors file: the load itself says so, in one line
            continue
        for name, info in header.items():
            dtype = info.get("dtype", "")
            if name.endswith(QUANT_SUFFIXES) or dtype in QUANT_DTYPES:
                found.append(f"{name} ({dtype})")
    return found


def checkpoint_scheme(
    path: Path,
    hf: dict,
    dequantized: Collection[str] = (),
    native: bool = True,
    quantize: str = "none",
    lora: bool = False,
    decompressed: Collection[str] = (),
) -> StoredScheme | None:
    """The stored scheme of path's pre-quantized checkpoint that batchgen loads as it is (None:
    float weights, or a format in dequantized, which the implementation that runs it
    dequantizes at load: MXFP4 on the transformers backend). ModelLoadError, one line, for any
    other quantized checkpoint; native: the implementation is batchgen's own decoder, else the
    transformers backend, which loads the formats in decompressed (their schemes as the native
    loader reads them) through transformers' quantizer, decompressed at load; quantize, lora:
    what is asked on top."""
    quant = read_checkpoint_quant(path, hf)
    if quant is not None and quant.method in dequantized:
        return None
    if quant is None:
        found = quantized_tensors(path)
        if found:
            shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if found[3:] else "")
            raise ModelLoadError(
                f"{path} holds quantized tensors ({shown}) but its config.json declares no "
                f"quantization_config, so their scheme is unknown; {FIX}"
            )
        return None
    loaded = native or quant.method in decompressed
    stored = stored_scheme(quant.config) if loaded else None
    if stored is not None and not native:
        stored = replace(stored, dequantized=True, transformers=True)
    if stored is None:
        where = "" if loaded else " on --model-impl transformers (use native)"
        raise ModelLoadError(
            f"{path} holds a pre-quantized checkpoint ({quant.description}), which batchgen "
            f"does not load{where}; {FIX}"
        )
    if stored.int4 is not None and hf.get("model_type") == "gpt2":
        # GPT-2's Conv1D weights are stored (in, out); INT4 packers transpose them to a
        # Linear's first, which the loader's Conv1D mapping would transpose again
        raise ModelLoadError(
            f"{path}: {quant.description} weights of a GPT-2 model (Conv1D layers) are not "
            f"loaded; {FIX}"
        )
    if quantize != "none":
        raise ModelLoadError(
            f"{path} is already quantized ({quant.description}); drop --quantize {quantize}"
        )
    if lora:
        raise ModelLoadError(
            f"a LoRA adapter cannot be merged into {path}'s quantized weights "
            f"({quant.description}); use the model's unquantized release with the adapter"
        )
    return stored
