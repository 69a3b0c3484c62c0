"""A rank's model: its slices of the checkpoint loaded, the LoRA adapter's slices merged, the
result quantized, and (with more than one rank) its collectives added. With one rank this is
the whole model, and how `LLM` loads it.

`RankSpec` is what a rank needs for that, out of the job's `ModelSpec`: small, picklable
values (no tokenizer, no grammars), so rank 0 can hand it to the other ranks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from batchgen.engine.compile_cache import CompileCache
from batchgen.job.model_spec import ModelSpec
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.checkpoint.lora import LoraAdapter, merge_lora
from batchgen.model.config import ModelConfig
from batchgen.model.families.packed_linear import can_pack, pack_linears
from batchgen.model.families.transformer import Transformer
from batchgen.model.hf.backend import load_hf_model
from batchgen.model.host_malloc import keep_freed_memory
from batchgen.model.parallel.collectives import CollectiveClock, apply_tensor_parallel
from batchgen.model.parallel.sharding import SINGLE, TPShard
from batchgen.quant import QuantScheme, quantize_model
from batchgen.quant.hf_quantize import quantize_hf_model


@dataclass(frozen=True, slots=True)
class RankSpec:
    model_dir: Path
    model_cfg: ModelConfig  # the whole model's
    dtype: torch.dtype
    device: torch.device  # rank 0's; rank r of a CUDA group runs on cuda:r
    compile: bool
    quant: QuantScheme
    lora: LoraAdapter | None
    allow_pickle: bool
    block_size: int
    tensor_parallel_size: int = 1
    compile_caches: tuple[CompileCache | None, ...] = ()  # by rank: each keeps its own

    @classmethod
    def of(cls, spec: ModelSpec) -> RankSpec:
        return cls(
            model_dir=spec.model_dir,
            model_cfg=spec.model_cfg,
            dtype=spec.dtype,
            device=spec.device,
            compile=spec.compile,
            quant=spec.quant,
            lora=spec.lora,
            allow_pickle=spec.allow_pickle,
            block_size=spec.engine.block_size,
            tensor_parallel_size=spec.tensor_parallel_size,
            compile_caches=tuple(
                spec.compile_cache_for(spec.quant, spec.lora, rank) if spec.compile else None
                for rank in range(spec.tensor_parallel_size)
            ),
        )

    def device_of(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device.type == "cuda" else self.device


@dataclass(slots=True)
class RankModel:
    model: Transformer  # or the transformers backend's HFModel
    quant: QuantScheme  # as produced (group sizes, weight format filled in)
    lora: LoraAdapter | None
    holds_malloc_tuning: bool = False  # whoever ends the model calls release_freed_memory


def load_rank_model(
    spec: RankSpec,
    tp: TPShard = SINGLE,
    group: ProcessGroup | None = None,
    clock: CollectiveClock | None = None,
) -> RankModel:
    """Rank tp's part of the model, ready to run (the whole model for one rank)."""
    device = spec.device_of(tp.rank)
    # activations are malloc'd: keep freed blocks for the next step
    tuned = device.type == "cpu" and keep_freed_memory()
    # When quantizing, load on the host: the pass moves one block at a time to the device
    # and quantizes it there, so the device never holds the float model.
    load_device = torch.device("cpu") if spec.quant.enabled else device
    model = load_model(
        spec.model_dir,
        spec.dtype,
        load_device,
        spec.allow_pickle,
        cfg=spec.model_cfg,
        tp=tp,
        stored=spec.quant.stored,  # a pre-quantized checkpoint's scheme, read by ModelSpec
    )
    # Merged before quantizing, into the float weights (this rank's slice of each update).
    lora = None
    if spec.lora is not None:
        lora = merge_lora(model, spec.lora, cfg=spec.model_cfg, tp=tp)
    quant = quantize_model(model, spec.quant, device)
    # Eager float32 on the CPU: weights packed once for oneDNN, after the LoRA merge and
    # before the TP hooks (model/families/packed_linear.py).
    if not spec.compile and not spec.quant.enabled and can_pack(device, spec.dtype):
        pack_linears(model)
    if tp.size > 1:  # after quantizing: some backends replace the linear modules
        apply_tensor_parallel(model, tp, group, clock)
    return RankModel(model, quant, lora, tuned)


def load_hf_rank_model(spec: RankSpec) -> RankModel:
    """The transformers backend's model (one rank, model/hf/backend.py): loaded, its adapter
    merged by peft, then quantized; when quantizing it loads on the host and the pass moves it
    to the device a layer at a time, as load_rank_model does."""
    at = torch.device("cpu") if spec.quant.enabled else spec.device
    hf = load_hf_model(spec.model_dir, spec.model_cfg, spec.dtype, at, spec.lora)
    return RankModel(hf, quantize_hf_model(hf, spec.quant, spec.device), spec.lora)
