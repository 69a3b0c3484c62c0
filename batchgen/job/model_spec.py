"""ModelSpec: a model and how to run it, resolved once.

`batchgen run` (job.open_job) and the Python API (`LLM`) resolve their arguments here and
nowhere else: the device, dtype and compile flag, config.json (read once), the tokenizer
(loaded once), the EOS ids, the quantization scheme (checked to run on the device), the LoRA
adapter (checked to fit), the engine's knobs over the device's defaults (EngineConfig.for_device)
and the grammar compiler of the vocabulary. Nothing here reads weights, so a wrong choice fails
before the model loads; `LLM.from_spec` then builds the model and the engine from the spec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.choices import Dtype, ModelImpl
from batchgen.engine.compile_cache import OFF, CompileCache, default_root
from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import Grammars
from batchgen.errors import ConfigError
from batchgen.job.backend_options import check_backend_options
from batchgen.job.generation import read_generation_config
from batchgen.job.tokenizer import check_vocab, eos_token_ids, load_tokenizer
from batchgen.model.attention.step import DECODE_ATTENTION_ENV
from batchgen.model.checkpoint.dequantized import check_experts, on_device
from batchgen.model.checkpoint.format import checkpoint_scheme
from batchgen.model.checkpoint.lora import LoraAdapter, check_adapter
from batchgen.model.checkpoint.multimodal import language_config
from batchgen.model.config import ModelConfig
from batchgen.model.families.hf_config import native_config, read_hf_config
from batchgen.model.hf.lora import check_hf_adapter
from batchgen.model.hf.refusal import DECOMPRESSED, DEQUANTIZED
from batchgen.model.hf.support import backend_config, resolve_impl
from batchgen.model.parallel.sharding import check_sizes
from batchgen.quant import QuantScheme, make_scheme
from batchgen.quant.scheme import stored_quant_scheme

DEFAULT_MODEL = Path(__file__).parents[1] / "assets" / "default-model"
DTYPES = {
    Dtype.FLOAT32: torch.float32,
    Dtype.BFLOAT16: torch.bfloat16,
    Dtype.FLOAT16: torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device} asked for, but torch sees no CUDA GPU; use --device cpu"
        )
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == Dtype.AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_compile_cache(root: str | Path | None) -> Path | None:
    """The compile cache's root: the caller's, else $BATCHGEN_COMPILE_CACHE, else
    ~/.cache/batchgen/compile; "off" (either way) turns it off."""
    chosen = str(root) if root is not None else str(default_root())
    return None if chosen == OFF else Path(chosen).expanduser()


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """None: compile on a GPU, run eager on the CPU. Measured (docs/architecture.md, The
    compiled path): on the CPU the compile costs one to two minutes cold against a 1.74x
    faster steady state on the demo model; on a GPU every step runs as CUDA graphs."""
    return device.type == "cuda" if compile is None else compile


def check_tensor_parallel(cfg: ModelConfig, n: int, device: torch.device) -> None:
    """ValueError (before any weight loads) for a split that cannot be: sizes n does not divide,
    more ranks than visible GPUs, or one GPU named for n ranks."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    if n == 1:
        return
    check_sizes(cfg, n)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"--device {device} names one GPU, and tensor_parallel_size {n} needs {n}: pass "
                "--device cuda and choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        visible = torch.cuda.device_count()
        if n > visible:
            raise ValueError(
                f"tensor_parallel_size {n} needs {n} GPUs and {visible} are visible; lower it "
                "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
            )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the engine is built from, resolved; no weights."""

    model_dir: Path
    generation_config: Mapping[str, Any]  # generation_config.json, read once ({}: none)
    model_cfg: ModelConfig
    tokenizer: Any
    eos_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    compile: bool
    quant: QuantScheme  # resolved and checked; quantize_model fills in what it produced
    lora: LoraAdapter | None  # checked against model_cfg, merged at load
    engine: EngineConfig
    grammars: Grammars  # compiles lazily, caching: a job's constraint is compiled once
    allow_pickle: bool = False
    tensor_parallel_size: int = 1  # ranks the model is split over (one process each)
    compile_cache: Path | None = None  # the compile cache's root (with compile); None: off

    def compile_cache_for(
        self, quant: QuantScheme, lora: LoraAdapter | None, rank: int = 0
    ) -> CompileCache | None:
        """The compile cache of this model as loaded, quantized and adapted
        (engine/compile_cache.py); None: off. Its key: what changes the compiled graphs."""
        if self.compile_cache is None:
            return None
        config = (self.model_dir / "config.json").read_bytes()
        parts = {
            "model_config": hashlib.sha256(config).hexdigest(),
            "dtype": str(self.dtype),
            "quantization": quant.to_dict(),
            "lora": lora.sha256 if lora is not None else None,
            "block_size": self.engine.block_size,
            "decode_attention": os.environ.get(DECODE_ATTENTION_ENV) or "device default",
            "tensor_parallel": [rank, self.tensor_parallel_size],
            "model_impl": self.model_cfg.impl.value,
        }
        return CompileCache.of(self.compile_cache, parts, self.device)

    @classmethod
    def resolve(
        cls,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str | torch.device = "auto",
        compile: bool | None = None,
        engine: EngineConfig | Mapping[str, Any] | None = None,
        allow_pickle: bool = False,
        quantize: str = "none",
        quant_backend: str = "auto",
        lora: str | Path | None = None,
        quant_group_size: int | None = None,
        tensor_parallel_size: int = 1,
        compile_cache: str | Path | None = None,
        model_impl: str = "auto",
    ) -> ModelSpec:
        """engine: an EngineConfig as it is, or values (None: unset) over the device's
        defaults. ConfigError for a device, dtype or engine value that cannot be;
        ModelLoadError, LoraError, QuantUnavailableError for the model, adapter, scheme.
        compile_cache: the compile cache's root (None: $BATCHGEN_COMPILE_CACHE, else
        ~/.cache/batchgen/compile; "off": none). model_impl: auto|native|transformers."""
        model_dir = Path(model) if model is not None else DEFAULT_MODEL
        hf = read_hf_config(model_dir, native=False)
        text = language_config(hf)  # a multimodal wrapper's text model runs text jobs
        try:
            impl = resolve_impl(model_impl, text.get("model_type"))
        except ValueError:
            names = "|".join(m.value for m in ModelImpl)
            raise ConfigError(f"model_impl {model_impl!r}: use one of {names}") from None
        if impl is ModelImpl.TRANSFORMERS:
            model_cfg = backend_config(model_dir)
            check_backend_options(quantize, tensor_parallel_size, model_dir)
            adapter = check_hf_adapter(lora, model_dir) if lora is not None else None
        else:
            model_cfg = native_config(model_dir, text)
            if text is not hf:  # reported as config.json's model (mistral3), not its text model
                model_cfg = dataclasses.replace(model_cfg, model_type=hf["model_type"])
            adapter = check_adapter(lora, model_cfg) if lora is not None else None
        try:
            dev = resolve_device(device)
            dt = resolve_dtype(dtype, dev)
            compiled = resolve_compile(compile, dev)  # the backend's too: both decode ops
            # carry its layers' scale, soft-cap and sinks (model/attention/decode_ops.py)
            if not isinstance(engine, EngineConfig):
                engine = EngineConfig.for_device(dev.type, compiled, **(engine or {}))
            check_tensor_parallel(model_cfg, tensor_parallel_size, dev)
        except ValueError as e:  # e.g. --device cuda on a machine without one
            raise ConfigError(str(e)) from None
        quant = make_scheme(quantize, quant_backend, dev, dt, group_size=quant_group_size)
        native = impl is ModelImpl.NATIVE  # a pre-quantized checkpoint's scheme, or refused:
        dequantized, decompressed = ((), ()) if native else (DEQUANTIZED, DECOMPRESSED)
        stored = checkpoint_scheme(
            model_dir, hf, dequantized, native, quantize, lora is not None, decompressed
        )
        if stored is not None:  # before the job writes anything
            check_experts(model_cfg, stored, model_dir)
            quant = stored_quant_scheme(on_device(stored, dev))  # fp8 on a CPU: dequantized
        tokenizer = load_tokenizer(model_dir, hf.get("model_type"))
        check_vocab(model_dir, len(tokenizer), model_cfg.vocab_size)
        gen = read_generation_config(model_dir)
        eos = eos_token_ids(gen, hf, tokenizer)
        return cls(
            model_dir=model_dir,
            model_cfg=model_cfg,
            tokenizer=tokenizer,
            eos_ids=tuple(eos),
            generation_config=gen,
            device=dev,
            dtype=dt,
            compile=compiled,
            quant=quant,
            lora=adapter,
            engine=engine,
            grammars=Grammars(tokenizer, model_cfg.vocab_size, eos),
            allow_pickle=allow_pickle,
            tensor_parallel_size=tensor_parallel_size,
            compile_cache=resolve_compile_cache(compile_cache) if compiled else None,
        )
