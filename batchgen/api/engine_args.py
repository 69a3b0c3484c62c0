"""`LLM(...)`'s arguments: vLLM's engine arguments by their names (EngineArgs), beside
batchgen's own, turned into `ModelSpec.resolve`'s options; an unknown one is refused in one
line naming the class the user called and the names it takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.choices import QuantMethod
from batchgen.errors import ConfigError
from batchgen.job.paths import BUILTIN, resolve_path

# vLLM's engine arguments batchgen takes, and what each becomes (None: handled by LLM itself).
VLLM_ENGINE = {  # -> EngineConfig's field
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "enable_prefix_caching": "prefix_caching",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "block_size": "block_size",
}
VLLM_OTHER = ("max_model_len", "enforce_eager", "seed", "tensor_parallel_size", "dtype")
VLLM_QUANTIZATION = "quantization"  # vLLM's: a checkpoint's method; here a scheme applied
# batchgen's own (ModelSpec.resolve's keywords)
BATCHGEN = (
    "device",
    "compile",
    "engine",
    "allow_pickle",
    "quantize",
    "quant_backend",
    "quant_group_size",
    "lora",
    "compile_cache",
    "model_impl",
    "kv_cache_tokens",
)
# vLLM's dtype names batchgen's dtypes answer to
_DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """LLM(...)'s arguments, sorted: `spec` for ModelSpec.resolve, and what LLM applies."""

    model: Path | None
    spec: dict[str, Any]
    max_model_len: int | None = None
    seed: int | None = 0  # vLLM's default: reruns of a script sample alike


def parse_engine_args(owner: str, model: str | Path | None, options: dict[str, Any]) -> EngineArgs:
    """owner: the class the user called (its name heads an unknown argument's error)."""
    known = (*VLLM_ENGINE, *VLLM_OTHER, VLLM_QUANTIZATION, *BATCHGEN)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"{owner}() got an unknown argument {unknown[0]!r}; it takes vLLM's engine "
            f"arguments {', '.join(sorted((*VLLM_ENGINE, *VLLM_OTHER, VLLM_QUANTIZATION)))} "
            f"and batchgen's {', '.join(BATCHGEN)} (docs/coming-from-vllm.md)"
        )
    opts = dict(options)
    engine = opts.pop("engine", None)
    values = {field: opts.pop(name) for name, field in VLLM_ENGINE.items() if name in opts}
    if "kv_cache_tokens" in opts:
        values["kv_cache_tokens"] = opts.pop("kv_cache_tokens")
    if values:
        if engine is not None:
            raise ConfigError(f"{owner}(): pass engine= or engine arguments, not both")
        engine = values
    if engine is not None:
        opts["engine"] = engine
    if opts.pop("enforce_eager", False):  # False: the device's default (compiled on a GPU)
        if opts.get("compile"):
            raise ConfigError(f"{owner}(): enforce_eager=True and compile=True contradict")
        opts["compile"] = False
    if "dtype" in opts:
        d = opts["dtype"]
        opts["dtype"] = _DTYPES.get(d, d) if isinstance(d, str) else str(d).removeprefix("torch.")
    if VLLM_QUANTIZATION in opts:
        opts["quantize"] = _quantization(owner, opts.pop(VLLM_QUANTIZATION), opts)
    max_len = opts.pop("max_model_len", None)
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)):
        raise ConfigError(f"max_model_len must be an integer, got {max_len!r}")
    if max_len is not None and max_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_len}")
    seed = opts.pop("seed", 0)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"seed must be an integer or None, got {seed!r}")
    if isinstance(model, str) and model.startswith(BUILTIN):
        model = resolve_path(model)
    path = Path(model) if model is not None else None
    return EngineArgs(path, opts, max_len, seed)


def _quantization(owner: str, value: Any, opts: dict[str, Any]) -> str:
    """vLLM's quantization= names a checkpoint's method; batchgen quantizes full-precision
    weights at load, by its own scheme names (int8, int4, fp8)."""
    if value is None:
        return opts.get("quantize", "none")
    names = [m.value for m in QuantMethod]
    if "quantize" in opts and opts["quantize"] != value:
        raise ConfigError(f"{owner}(): quantization={value!r} and quantize: pass one")
    if value not in names:
        raise ConfigError(
            f"quantization={value!r}: batchgen quantizes weights at load with one of "
            f"{', '.join(names)}; pre-quantized checkpoints (awq, gptq, ...) are not read"
        )
    return value
