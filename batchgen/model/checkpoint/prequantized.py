"""Pre-quantized checkpoints loaded as they are stored: each decoder linear's fp8 or int8
weight and its scales become one torchao weight tensor (Float8Tensor, Int8Tensor: the tensors
`--quantize fp8|int8` produces), so the model holds the checkpoint's bytes, never a float copy;
where no kernel takes them (fp8 on the CPU, a MoE model's experts) they are dequantized at
load instead, one at a time (model/checkpoint/dequantized.py).
INT4 formats (compressed-tensors W4A16, GPTQ, AWQ: int4_formats.py) reach the loader unpacked
to int8 q - z and group scales (int4_tensors.py) and become Int4OpaqueTensor where a kernel
takes them.

Which checkpoints: the scheme is read from the checkpoint's quantization_config
(`stored_scheme`), never guessed; one this module does not take is refused before loading
(model/checkpoint/format.py). The loader (model/checkpoint/loader.py) reads each weight in its
stored dtype and its scale into rows that follow the weight's: the scale of q, k and v (or gate and
up) land in the rows of the fused matrix that their weights fill, and a tensor-parallel rank takes
the scale rows of its weight rows (a row-parallel layer, split along its input, keeps them whole,
or its blocks' columns). Scales are kept per row (`scale_rows`: a per-tensor scale repeated,
a block's repeated over its rows), which is what makes fusing and splitting plain row copies.

Activations: a checkpoint's input quantization (W8A8: dynamic per token, or a static
per-tensor `input_scale` per layer) is applied as its format computes it (activation_quant.py);
the layers fused into one (q, k, v; gate, up) take one input, so their static scales must be
equal (calibrated on that one input, they are), else the checkpoint is refused. Block FP8's
activations stay in the model dtype, as transformers runs such a checkpoint without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.int4_formats import Int4Layout, int4_layout
from batchgen.model.checkpoint.int4_tensors import int4_weight
from batchgen.model.config import ModelConfig
from batchgen.model.parallel.sharding import Copy
from batchgen.model.quiet_import import quiet_torchao

SCALE = ".scale"  # our key of a weight's scale rows: "layers.0.attn.wqkv.weight.scale"
INPUT_SCALE = ".input_scale"  # our key of a layer's static input scale, by its weight's


@dataclass(frozen=True, slots=True)
class StoredScheme:
    """How a checkpoint stores its decoder linears' weights, as its config declares."""

    source: str  # "compressed-tensors float-quantized", "fp8 (DeepSeek/Qwen3 blocks)"
    weights: str  # "fp8" | "int8" | "int4"
    granularity: str  # "per channel", "per tensor", "blocks of 128x128"
    scale_suffix: str  # the checkpoint's scale name after the module's: "weight_scale"
    block: tuple[int, int] | None = None  # (rows, columns) a block (or group) scale covers
    activations: str = "not quantized"  # what the checkpoint does to them
    # the layers' inputs quantized as the checkpoint does (activation_quant.py): "dynamic"
    # (a scale per token) or "static" (the checkpoint's input_scale per layer); None: not
    act: str | None = None
    int4: Int4Layout | None = None  # an INT4 format's packing (int4_formats.py)
    # no matmul kernel takes the stored weights on the device that runs them: they are
    # dequantized at load to the model dtype (dequantized.on_device)
    dequantized: bool = False
    # fp8 weights and dynamic per-token fp8 activations run as one fp8 x fp8 GEMM (torchao's
    # Float8Tensor quantizing its input, torch._scaled_mm: CUDA sm90+; dequantized.on_device)
    fp8_gemm: bool = False
    # loaded by the transformers backend: transformers' quantizer decompresses the weights to
    # the model dtype at load (format.checkpoint_scheme; dequantized is set too)
    transformers: bool = False

    def describe(self) -> str:
        how = f"{self.source}, {self.granularity}; activations: {self.activations}"
        if self.transformers:
            return how + "; decompressed at load by transformers"
        if self.fp8_gemm:
            return how + "; fp8 x fp8 GEMM"
        return how + ("; dequantized at load (no fp8 matmul here)" if self.dequantized else "")


def _compressed_tensors(q: dict) -> StoredScheme | None:
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    fmt = {g.get("format") or q.get("format") for g in groups}
    if len(groups) != 1 or q.get("kv_cache_scheme") or q.get("sparsity_config"):
        return None
    if q.get("transform_config") or len(fmt) != 1:
        return None
    (group,) = groups
    w, act = group.get("weights") or {}, group.get("input_activations")
    kind = {
        ("float-quantized", "float"): "fp8",
        ("naive-quantized", "float"): "fp8",  # the same tensors, written without activations
        ("int-quantized", "int"): "int8",
        ("naive-quantized", "int"): "int8",
    }.get((next(iter(fmt)), w.get("type")))
    if kind is None or w.get("num_bits") != 8 or not w.get("symmetric", True):
        return None
    if w.get("dynamic") or w.get("strategy") not in ("tensor", "channel", "group"):
        return None
    size = w.get("group_size") if w["strategy"] == "group" else None
    if w["strategy"] == "group" and not isinstance(size, int):
        return None
    if group.get("output_activations") or group.get("targets") != ["Linear"]:
        return None
    acts, how = "not quantized", None
    if act:
        how = {("token", True): "dynamic", ("tensor", False): "static"}.get(
            (act.get("strategy"), bool(act.get("dynamic")))
        )
        if act.get("type") != w.get("type") or act.get("num_bits") != 8 or how is None:
            return None
        if not act.get("symmetric", True):
            return None
        acts = f"8-bit {act['type']}, {how} per {act['strategy']}"
    return StoredScheme(
        f"compressed-tensors {next(iter(fmt))}",
        kind,
        f"groups of {size}" if size else f"per {w['strategy']}",
        "weight_scale",
        block=(1, size) if size else None,
        activations=acts,
        act=how,
    )


def _block_fp8(q: dict) -> StoredScheme | None:
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        return None
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        return None
    return StoredScheme(
        "fp8 (block scales, weight_scale_inv)",
        "fp8",
        f"blocks of {block[0]}x{block[1]}",
        "weight_scale_inv",
        block=(block[0], block[1]),
        # as transformers runs it without a GPU (it dequantizes); GPU kernels (DeepGEMM,
        # vLLM) quantize them to fp8 per token and 128 features
        activations="not quantized",
    )


def _modelopt(q: dict) -> StoredScheme | None:
    """NVIDIA ModelOpt's FP8: fp8 weights with a per-tensor weight_scale, and a static
    per-tensor input_scale for each layer's input."""
    if q.get("quant_algo") != "FP8" or q.get("kv_cache_quant_algo"):
        return None
    static = "8-bit float, static per tensor"
    return StoredScheme("modelopt FP8", "fp8", "per tensor", "weight_scale", None, static, "static")


def _int4(layout: Int4Layout) -> StoredScheme:
    block = (1, layout.group) if layout.group else None
    return StoredScheme(
        layout.source, "int4", layout.granularity, "weight_scale", block, int4=layout
    )


def stored_scheme(q: dict) -> StoredScheme | None:
    """The scheme a quantization_config declares, if batchgen loads it; None otherwise."""
    method = q.get("quant_method")
    layout = int4_layout(q)
    if layout is not None:
        return _int4(layout)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _block_fp8(q)
    if method == "modelopt":
        return _modelopt(q)
    return None


def scale_rows(scale: torch.Tensor, shape: tuple[int, int], s: StoredScheme) -> torch.Tensor:
    """A checkpoint weight's scale as one row per weight row: (out, 1), or with block scales
    (out, in / block columns)."""
    out, n_in = shape
    scale = scale.to(torch.float32)
    if s.block is None:
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(out, 1).contiguous()
        return scale.reshape(out, 1)
    br, bc = s.block
    if n_in % bc:
        raise ModelLoadError(
            f"a {out}x{n_in} weight in blocks of {br}x{bc}: its input width is not a whole "
            "number of blocks, which batchgen's quantized tensors cannot hold; use the model's "
            "bf16 release with --quantize"
        )
    return scale.repeat_interleave(br, dim=0)[:out]


def scale_copy(copy: Copy, s: StoredScheme) -> Copy:
    """The copy of scale rows that goes with a copy of weight rows: the same rows; a split of
    the input columns takes the blocks' columns (all of a per-row scale)."""
    if copy.dim == 0:
        return copy
    if s.block is None:
        return Copy(0, None, copy.dst)
    bc, src = s.block[1], copy.src
    if src.start % bc or src.stop % bc:
        raise ModelLoadError(
            f"tensor parallelism splits a layer's input at {src.start}..{src.stop}, inside its "
            f"{bc}-column fp8 scale blocks; use fewer ranks"
        )
    return Copy(1, slice(src.start // bc, src.stop // bc), copy.dst)


def quantized_weight(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, s: StoredScheme):
    """The torchao weight tensor of a (out, in) stored weight and its (out, k) scale rows,
    computing in dtype."""
    if s.weights == "int4":
        return int4_weight(qdata, scale, dtype)
    block = [1, qdata.shape[1] // scale.shape[1]]
    with quiet_torchao():
        if s.weights == "fp8":
            from torchao.quantization import Float8Tensor

            return Float8Tensor(qdata, scale, block_size=block, dtype=dtype, **_fp8_gemm(s))
        from torchao.quantization import Int8Tensor

    return Int8Tensor(qdata, scale, block_size=block, dtype=dtype)


def _fp8_gemm(s: StoredScheme) -> dict:
    """Float8Tensor's settings for s: with fp8_gemm, the input quantized per token (a row's
    max / 448, as the checkpoint's dynamic activations and activation_quant.TokenQuant) and
    multiplied by torch._scaled_mm with fp32 accumulation; else none (weight-only: the weight
    dequantized at each call)."""
    if not s.fp8_gemm:
        return {}
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.common import KernelPreference
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (
        QuantizeTensorToFloat8Kwargs,
    )

    return {
        "mm_config": Float8MMConfig(use_fast_accum=True),
        "act_quant_kwargs": QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, PerRow()),
        "kernel_preference": KernelPreference.AUTO,  # mslk's rowwise kernel where installed
    }


def stored_bytes(cfg: ModelConfig, dtype_bytes: int, s: StoredScheme | None = None) -> int:
    """Bytes of cfg's parameters (one rank's config) with the decoder linears stored at a byte
    a weight (half a byte: INT4, s) and the rest at dtype_bytes: a MoE layer's experts and
    router too, dequantized at load (dequantized.py), and every linear where s is dequantized
    at load. The scales (4 bytes a row, or a row's block) are left out, under 1% for layers
    256 or more wide."""
    if s is not None and s.dequantized:
        return cfg.num_params * dtype_bytes
    d, hd = cfg.dim, cfg.head_dim
    attn = (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * hd * d
    mlp = (3 if cfg.gated_mlp else 2) * cfg.intermediate_size * d
    linears = cfg.n_layers * attn + (cfg.n_layers - cfg.n_moe_layers) * mlp
    stored = linears // 2 if s is not None and s.weights == "int4" else linears
    return (cfg.num_params - linears) * dtype_bytes + stored


def check_widths(cfg: ModelConfig, s: StoredScheme) -> None:
    """ModelLoadError, before any weight is read, where a decoder linear's input width (this
    rank's, cfg: its config) is not a whole number of s's scale blocks (or groups)."""
    if s.block is None:
        return
    bc = s.block[1]
    widths = {"hidden": cfg.dim, "attention output": cfg.n_heads * cfg.head_dim}
    widths["MLP"] = cfg.intermediate_size
    odd = {k: w for k, w in widths.items() if w % bc}
    if odd:
        shown = ", ".join(f"{k} {w}" for k, w in odd.items())
        raise ModelLoadError(
            f"{s.source}: input widths ({shown}, on this rank) are not a whole number of "
            f"{bc}-column scale blocks, which batchgen's quantized tensors cannot hold; use "
            "fewer tensor-parallel ranks, or the model's bf16 release with --quantize"
        )
