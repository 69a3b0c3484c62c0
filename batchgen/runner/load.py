"""A run's model: loaded for the job (its pool sized for the job's longest row where that
matters), described (RunInfo, the part files' metadata) and costed (the roofline's model)."""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack

from batchgen.choices import Task
from batchgen.data import OutputDir
from batchgen.job.fingerprint import check_weights
from batchgen.job.open import Job
from batchgen.llm import LLM
from batchgen.stats.nvml import NvmlSampler
from batchgen.stats.peaks import resolve_peaks
from batchgen.stats.roofline import ModelCost
from batchgen.stats.run_stats import RunInfo, RunStats

log = logging.getLogger(__name__)


def load_model(job: Job, out: OutputDir, done: set, stats: RunStats, scope: ExitStack) -> LLM:
    """The job's LLM, closed (its ranks ended) when scope ends; its load recorded in stats."""
    cfg, spec = job.cfg, job.spec
    longest = _job_longest_row(job, done)
    t0 = time.perf_counter()
    llm = scope.enter_context(LLM.from_spec(spec))
    check_weights(out, llm.quant.to_dict())  # what the weights became, before any row is added
    if longest is not None:  # a pool sized for every row, not only the first window's
        llm.engine.reserve(longest)
    info = _run_info(llm)
    load_s = time.perf_counter() - t0
    tp = spec.tensor_parallel_size
    peaks = resolve_peaks(spec.device, spec.dtype, cfg.peak_tflops, cfg.peak_bandwidth_gbs, tp)
    stats.loaded(info, load_s, _model_cost(llm, info, cfg.task), peaks)
    return llm


def part_metadata(info: RunInfo, id_column: str) -> dict[bytes | str, bytes | str]:
    """The model, quantization scheme and adapter travel with every part file, not only
    stats.json."""
    meta = {"model": info.model, "dtype": info.dtype, "quantization": info.quantization}
    meta["id_column"] = id_column
    if info.lora is not None:
        meta["lora"] = info.lora
    return {"batchgen": json.dumps(meta)}


def gpu_sampler(llm: LLM) -> NvmlSampler | None:
    """NVML's sampler of every rank's GPU, started (None off CUDA): rank r of a
    tensor-parallel job runs on cuda:r (parallel/rank_model.py)."""
    device, tp = llm.spec.device, llm.spec.tensor_parallel_size
    if device.type != "cuda":
        return None
    return NvmlSampler(range(tp) if tp > 1 else [device.index or 0]).start()


def _run_info(llm: LLM) -> RunInfo:
    spec = llm.spec
    return RunInfo(
        model=str(spec.model_dir),
        family=spec.model_cfg.model_type,
        model_impl=spec.model_cfg.impl.value,
        device=str(spec.device),
        dtype=str(spec.dtype).removeprefix("torch."),
        compiled=spec.compile,
        max_num_seqs=spec.engine.max_num_seqs,
        max_num_batched_tokens=spec.engine.max_num_batched_tokens,
        block_size=spec.engine.block_size,
        prefix_caching=spec.engine.prefix_caching,
        quantization=llm.quant.to_dict(),
        lora=llm.lora.to_dict() if llm.lora is not None else None,
        tensor_parallel_size=spec.tensor_parallel_size,
        weights_bytes_per_rank=llm.weights_bytes_per_rank,
    )


def _model_cost(llm: LLM, info: RunInfo, task: Task) -> ModelCost:
    """What the job's tokens cost (stats/roofline.py; the task decides the head). A decode
    step reads every weight but the input embedding, a gather of a few rows (unless it is
    also the LM head)."""
    cfg, dtype_bytes = llm.spec.model_cfg, llm.spec.dtype.itemsize
    weights = info.weights_bytes_per_rank * info.tensor_parallel_size
    if not cfg.tie_embeddings:
        weights -= cfg.vocab_size * cfg.dim * dtype_bytes
    return ModelCost.from_config(cfg, dtype_bytes, weights, task)


def _job_longest_row(job: Job, done: set) -> int | None:
    """The job's longest row where the KV pool is sized from it (no --kv-cache-tokens, not
    on a GPU) and the first read-ahead window may not hold every row: a pass over the input
    that tokenizes it once more, so a row's result never depends on where it sits."""
    cfg, spec, source = job.cfg, job.spec, job.source
    if spec.device.type == "cuda" or spec.engine.kv_cache_tokens is not None:
        return None
    rows = source.num_rows if cfg.limit is None else min(cfg.limit, source.num_rows or cfg.limit)
    if rows is not None and rows <= spec.engine.read_ahead and not job.prep.samples:
        return None  # the first window is the whole job
    t0 = time.perf_counter()
    longest = job.prep.longest_row(done)
    log.info(
        "length pass: the longest row is %d tokens (%.1f s)", longest, time.perf_counter() - t0
    )
    return longest
