"""`batchgen plan`: what a job would run, without loading the weights: its rows and prompt
lengths, the engine's budgets and the KV pool it would allocate."""

from __future__ import annotations

from collections import Counter
from typing import Any

from batchgen.engine.kv_sizing import pool_blocks
from batchgen.job.config import RunConfig
from batchgen.job.model_spec import ModelSpec
from batchgen.job.open import open_job
from batchgen.model.checkpoint.notes import load_notes
from batchgen.model.checkpoint.prequantized import stored_bytes
from batchgen.model.families.hf_config import read_hf_config
from batchgen.model.memory import available_bytes, format_bytes
from batchgen.model.parallel.sharding import TPShard, local_config, weight_bytes


def _edge(n: int) -> int:
    """The power of two at or above n (the histogram's bins)."""
    return 1 << max(0, (n - 1).bit_length())


def make_plan(cfg: RunConfig) -> dict[str, Any]:
    job = open_job(cfg)
    spec = job.spec
    eng = spec.engine
    hist: Counter = Counter()
    rows = prompts = errors = prompt_tokens = output_tokens = longest = 0
    for _, window in job.prep.windows(done=set()):
        rows += len(window.rows)  # output records: one a sample (n) of each prompt
        prompts += len({row.id for row in window.rows})
        errors += len(window.errors)
        for r in window.requests:
            if not window.rows[r.index].sample_index:  # a prompt once, not once a sample
                hist[_edge(r.prompt_len)] += 1
            prompt_tokens += r.prompt_len
            longest = max(longest, r.longest_tokens)
            if not (r.candidates or r.scoring):  # score, prompt-logprobs rows: none generated
                output_tokens += r.params.max_new_tokens
    tp = spec.tensor_parallel_size
    # each rank holds its own KV heads: the pool's blocks are the same on every rank
    kv_per_token = local_config(spec.model_cfg, TPShard(0, tp)).kv_bytes_per_token(
        spec.dtype.itemsize
    )
    blocks = (
        None
        if spec.device.type == "cuda" and eng.kv_cache_tokens is None
        else pool_blocks(eng, longest, None, kv_per_token * eng.block_size)
    )
    kv_bytes = None if blocks is None else blocks * eng.block_size * kv_per_token  # a rank's
    weights = weight_bytes(spec.model_cfg, spec.dtype.itemsize, tp)  # a rank's
    if spec.quant.checkpoint:  # a pre-quantized checkpoint's linears, as stored
        weights = stored_bytes(
            local_config(spec.model_cfg, TPShard(0, tp)), spec.dtype.itemsize, spec.quant.stored
        )
    hf = read_hf_config(spec.model_dir, native=False)
    dtype = str(spec.dtype).removeprefix("torch.")
    return {
        "warnings": memory_warnings(spec, kv_bytes, weights),
        "input": cfg.input,
        "model": str(spec.model_dir),
        "model_type": spec.model_cfg.model_type,
        "model_impl": spec.model_cfg.impl.value,
        "dtype": dtype,
        "load_notes": load_notes(
            spec.model_dir,
            hf,
            weights * tp,
            dtype,
            spec.quant.stored,
            bool(spec.model_cfg.n_experts),
            spec.device.type,
        ),
        "rows": rows,
        "prompts": prompts,
        "rows_error": errors,
        "prompt_tokens": prompt_tokens,
        "max_output_tokens": output_tokens,
        "longest_row_tokens": longest,
        "max_model_len": job.max_model_len,
        "max_prompt_len": job.max_prompt_len,
        "generation_defaults": job.generation.to_dict(),
        "length_histogram": {str(k): v for k, v in sorted(hist.items())},
        "max_num_seqs": eng.max_num_seqs,
        "max_num_batched_tokens": eng.max_num_batched_tokens,
        "block_size": eng.block_size,
        "prefix_caching": eng.prefix_caching,
        "kv_cache_blocks": blocks,
        "gpu_memory_utilization": eng.gpu_memory_utilization,
        "tensor_parallel_size": tp,
        "weights_bytes_per_rank": weights,
        "weights_stored_as": spec.quant.checkpoint,  # None: float weights
        "kv_cache_bytes": None if kv_bytes is None else kv_bytes * tp,
        "kv_cache_bytes_per_rank": kv_bytes,
    }


def memory_warnings(spec: ModelSpec, kv_bytes: int | None, weights: int) -> list[str]:
    """What would not fit in free memory: the KV cache, or it and the weights. kv_bytes and
    weights are one rank's: each GPU holds its rank's, while on the CPU all ranks share it."""
    if kv_bytes is None:  # sized on a GPU at start, from its free memory
        return []
    free = available_bytes(spec.device)
    if free is None:
        return []
    if spec.device.type == "cpu":
        kv_bytes, weights = (
            kv_bytes * spec.tensor_parallel_size,
            weights * spec.tensor_parallel_size,
        )
    fix = "lower --max-new-tokens or --max-num-seqs, or set --kv-cache-tokens"
    if kv_bytes > free:
        return [
            f"the KV cache ({format_bytes(kv_bytes)}) exceeds the {format_bytes(free)} free on "
            f"{spec.device}: the run would be refused; {fix}"
        ]
    if kv_bytes + weights > free:
        return [
            f"the KV cache ({format_bytes(kv_bytes)}) and the weights ({format_bytes(weights)}) "
            f"exceed the {format_bytes(free)} free on {spec.device}; {fix}"
        ]
    return []


def _rows(p: dict[str, Any]) -> str:
    """The input's prompts, and the output rows their samples make where that is more."""
    if p["rows"] == p["prompts"]:
        return str(p["rows"])
    return f"{p['prompts']} prompts, {p['rows']} output rows (samples)"


def format_plan(p: dict[str, Any]) -> str:
    lines = [
        f"input   {p['input']}",
        f"model   {p['model']} ({p['model_type']}, {p['model_impl']}, {p['dtype']})",
        f"rows    {_rows(p)} ({p['rows_error']} would get an error record)",
        f"tokens  {p['prompt_tokens']} prompt, up to {p['max_output_tokens']} output; "
        f"longest row {p['longest_row_tokens']}",
        f"limits  prompt <= {p['max_prompt_len']} tokens, prompt + output <= "
        f"{p['max_model_len']} (max_model_len)",
        "defaults "
        + ", ".join(
            f"{k} {v['value']:g} ({v['from']})" for k, v in p["generation_defaults"].items()
        ),
        "",
        "prompt length histogram (tokens, up to: prompts)",
    ]
    peak = max(p["length_histogram"].values(), default=1)
    for edge, n in p["length_histogram"].items():
        lines.append(f"  <= {edge:>6}  {n:>8}  {'#' * max(1, round(40 * n / peak))}")
    util = p["gpu_memory_utilization"]
    kv = (
        f"sized after the warm-up: {util:.0%} of the GPU's memory, less the weights "
        f"({p['weights_bytes_per_rank'] / 2**30:.2f} GiB), the CUDA context and graphs and the "
        "warm-up's peak activations (measured)"
        if p["kv_cache_blocks"] is None
        else f"{p['kv_cache_blocks']} blocks of {p['block_size']} tokens = "
        f"{p['kv_cache_bytes_per_rank'] / 2**20:.1f} MiB"
    )
    ranks = p["tensor_parallel_size"]
    per = f" per rank, {ranks} tensor-parallel ranks" if ranks > 1 else ""
    lines += [
        "",
        f"engine   up to {p['max_num_seqs']} sequences, {p['max_num_batched_tokens']} tokens a "
        "step, "
        f"prefix caching {'on' if p['prefix_caching'] else 'off'}",
        f"weights  {p['weights_bytes_per_rank'] / 2**20:.1f} MiB at {p['dtype']}{per} "
        f"({p['weights_stored_as'] or 'before any quantization'})",
        f"KV cache {kv}{per if p['kv_cache_blocks'] is not None else ''}",
    ]
    lines += [f"note: {n}" for n in p["load_notes"]]
    lines += [f"warning: {w}" for w in p["warnings"]]
    return "\n".join(lines)
