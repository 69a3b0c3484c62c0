"""What the transformers backend (model/hf/backend.py) refuses of a job's options, before any
weight loads: tensor parallelism (its sharding is native), int4 (its group sizes are chosen
per native layer kind, quant/quantize.py), and --quantize on a model whose MoE experts are 3-D
weights (the passes quantize nn.Linear layers: most of such a model would stay float). LoRA
adapters are checked by model/hf/lora.py."""

from __future__ import annotations

from pathlib import Path

from batchgen.errors import ConfigError
from batchgen.model.hf.support import load_plan, meta_model

BACKEND_QUANTIZE = ("int8", "fp8")  # weight-only, one scale per output channel


def check_backend_options(quantize: str | None, tensor_parallel_size: int, model_dir: Path) -> None:
    """ConfigError naming the first option the transformers backend cannot run."""
    prefix = "the transformers backend (--model-impl transformers) does not support"
    if tensor_parallel_size != 1:
        raise ConfigError(f"{prefix} tensor parallelism (its sharding is native-only)")
    if quantize in ("none", None):
        return
    if quantize not in BACKEND_QUANTIZE:
        raise ConfigError(
            f"{prefix} --quantize {quantize} (its group sizes are chosen per native layer); "
            f"use --quantize {' or '.join(BACKEND_QUANTIZE)}"
        )
    params = dict(meta_model(load_plan(model_dir)).named_parameters())
    experts = [n for n, p in params.items() if p.dim() == 3]
    if experts:
        share = sum(params[n].numel() for n in experts) / sum(p.numel() for p in params.values())
        raise ConfigError(
            f"--quantize on the transformers backend quantizes linear layers, and {share:.0%} "
            f"of this model's parameters are MoE experts held as 3-D weights ({experts[0]}, "
            "...), which it cannot quantize; run it unquantized, at a smaller --dtype"
        )
