"""run(config): reader -> prepare/planner -> engine -> writer, with stats alongside."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from batchgen.config import ConfigError, RunConfig
from batchgen.data import InputSource, OutputDir, PartBuffer, open_input, output_schema
from batchgen.engine.sequence import Completion, FinishReason
from batchgen.fingerprint import content_fingerprint
from batchgen.llm import DEFAULT_MODEL, LLM, load_tokenizer, resolve_device, resolve_dtype
from batchgen.memory import check_allocation
from batchgen.model.config import ModelConfig
from batchgen.model.loader import config_from_hf, read_hf_config
from batchgen.nvml import NvmlSampler
from batchgen.planner import BucketConfig
from batchgen.prepare import Preparer, Row
from batchgen.stats import RunStats, peak_memory_bytes

log = logging.getLogger(__name__)


class JobInterrupted(Exception):
    """SIGTERM/SIGINT arrived; finished rows are written and a rerun resumes."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: finished rows are saved; "
            "run the same command again to resume"
        )


@contextmanager
def _stop_on_signals():
    """Turn the first SIGTERM/SIGINT into a flag checked between batches; a second
    SIGINT interrupts at once."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def default_max_batch(device: torch.device) -> int:
    return 256 if device.type == "cuda" else 64


def kv_cache_tokens(cfg: RunConfig, model_cfg, dtype: torch.dtype, device: torch.device) -> int:
    """KV cache capacity in tokens: the flag; on a GPU, 80% of the memory left free once
    the (unquantized) weights are in; on the CPU, 2 GiB."""
    per_token = model_cfg.kv_bytes_per_token(dtype.itemsize)
    if cfg.kv_cache_tokens:
        what = f"a KV cache of {cfg.kv_cache_tokens} tokens"
        check_allocation(cfg.kv_cache_tokens * per_token, what, "--kv-cache-tokens", device)
        return cfg.kv_cache_tokens
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free -= model_cfg.num_params * dtype.itemsize
        return max(4096, int(free * 0.8) // per_token)
    return min(262144, (2 << 30) // per_token)


def _row_record(row: Row, c: Completion | None, cfg: RunConfig) -> dict[str, Any]:
    rec = {"id": row.id, **row.passthrough}
    rec.update(
        text=c.text if c else None,
        finish_reason=c.finish_reason.value if c else FinishReason.ERROR.value,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=c.completion_tokens if c else 0,
        error=row.error if c is None else None,
    )
    if cfg.with_token_ids:
        rec["token_ids"] = c.token_ids if c else None
    if cfg.with_logprobs:
        rec["logprobs"] = c.logprobs if c else None
    return rec


@dataclass(slots=True)
class Job:
    """A job opened and checked without loading the weights."""

    cfg: RunConfig
    model_dir: Path
    model_cfg: ModelConfig
    source: InputSource
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    prep: Preparer
    buckets: BucketConfig


def open_job(cfg: RunConfig) -> Job:
    """Check everything that can fail before the model loads: model config, input file
    and columns, prompt template, length limits."""
    model_dir = Path(cfg.model) if cfg.model else DEFAULT_MODEL
    if cfg.quant_group_size is not None:  # TODO(lead): pass it to LLM -> make_scheme(group_size=)
        raise ConfigError("--quant-group-size is not wired into the engine yet; leave it out")
    model_cfg = config_from_hf(read_hf_config(model_dir))
    source = open_input(cfg.input)
    tokenizer = load_tokenizer(model_dir)
    try:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
    except ValueError as e:  # e.g. --device cuda on a machine without one
        raise ConfigError(str(e)) from None
    max_seq = model_cfg.max_position_embeddings
    max_prompt = min(
        cfg.max_prompt_len, max_seq - BucketConfig().new_tokens_bucket(cfg.max_new_tokens)
    )
    if max_prompt < 1:
        raise ConfigError(
            f"max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in the model's "
            f"{max_seq} positions"
        )
    buckets = BucketConfig(
        max_prompt_len=max_prompt,
        max_batch=cfg.max_batch or default_max_batch(device),
        prefill_token_budget=cfg.prefill_token_budget,
        kv_capacity_tokens=kv_cache_tokens(cfg, model_cfg, dtype, device),
    )
    prep = Preparer(cfg, source, tokenizer, max_prompt, max_seq)
    return Job(cfg, model_dir, model_cfg, source, tokenizer, device, dtype, prep, buckets)


def run(cfg: RunConfig) -> RunStats:
    """Run one job to completion (or to a signal); returns its statistics."""
    # The output directory stays locked from its opening to the job's end, however it ends.
    with ExitStack() as job_scope:
        return _run(cfg, job_scope)


def _run(cfg: RunConfig, job_scope: ExitStack) -> RunStats:
    stats = RunStats()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    job = open_job(cfg)
    model_dir, model_cfg, source, device, prep = (
        job.model_dir,
        job.model_cfg,
        job.source,
        job.device,
        job.prep,
    )
    passthrough = pa.schema([source.schema.field(c) for c in prep.passthrough])
    schema = output_schema(prep.id_type, passthrough, cfg.with_token_ids, cfg.with_logprobs)
    fingerprint = {**cfg.fingerprint(), **content_fingerprint(model_dir, source)}
    out = job_scope.enter_context(OutputDir(cfg.output_dir, fingerprint, cfg.overwrite))
    done = out.done_ids()
    stats.rows_skipped_done = len(done)
    if out.is_complete:
        log.warning(
            "%s already holds this job's complete results; --overwrite reruns it", cfg.output_dir
        )
        stats.extra["complete"] = True
        stats.finish()
        return stats

    t0 = time.perf_counter()
    buckets = job.buckets
    llm = LLM(
        model_dir,
        dtype=cfg.dtype,
        device=cfg.device,
        compile=cfg.compile,
        buckets=buckets,
        allow_pickle=cfg.allow_pickle,
        schedule=cfg.schedule,
        prefix_reuse=cfg.prefix_reuse,
        quantize=cfg.quantize,
        quant_backend=cfg.quant_backend,
    )
    stats.load_s = time.perf_counter() - t0
    stats.extra.update(
        model=str(model_dir),
        family=model_cfg.family.value,
        device=str(device),
        dtype=str(llm.dtype).removeprefix("torch."),
        compiled=llm.compile,
        kv_cache_tokens=buckets.kv_capacity_tokens,
        schedule=cfg.schedule,
    )
    # The model and quantization scheme travel with every part file, not only _stats.json.
    meta = {
        "model": str(model_dir),
        "dtype": stats.extra["dtype"],
        "quantization": llm.quant.to_dict(),
    }
    schema = schema.with_metadata({"batchgen": json.dumps(meta)})
    nvml = NvmlSampler(device.index or 0).start() if device.type == "cuda" else None
    buffer = PartBuffer(out, cfg.rows_per_part, schema)
    progress = _progress(cfg, source.num_rows)
    last_flush = time.monotonic()
    complete = False
    # Signals stay deferred until the results are flushed and marked: a SIGTERM during the
    # last writes cannot leave a finished job looking unfinished.
    with _stop_on_signals() as signals:
        try:
            for n_read, window in prep.windows(done):
                errors = [_row_record(r, None, cfg) for r in window.errors]
                buffer.add(errors)
                stats.rows += len(errors)
                stats.rows_error += len(errors)
                progress.update(n_read - len(window.rows) + len(errors))
                for batch, completions in llm.engine.generate(window.requests):
                    buffer.add(_row_record(window.rows[c.index], c, cfg) for c in completions)
                    stats.rows += len(completions)
                    stats.batches += 1
                    stats.prompt_tokens += sum(c.prompt_tokens for c in completions)
                    stats.computed_prompt_tokens += batch.computed_prompt_tokens
                    stats.output_tokens += sum(c.completion_tokens for c in completions)
                    progress.update(len(completions))
                    progress.set_postfix_str(f"{stats.rate(stats.output_tokens):.0f} out tok/s")
                    if time.monotonic() - last_flush > cfg.flush_seconds:
                        buffer.flush()
                        last_flush = time.monotonic()
                    if signals:
                        raise JobInterrupted(signals[0])
                if signals:
                    raise JobInterrupted(signals[0])
            complete = True
        finally:
            buffer.flush()  # on a signal too: every finished row is kept
            progress.close()
            _finish_stats(stats, llm, device, nvml)
            stats.extra["complete"] = complete
            out.write_stats(stats.to_dict())
        out.mark_success()
    return stats


def _finish_stats(
    stats: RunStats, llm: LLM, device: torch.device, nvml: NvmlSampler | None
) -> None:
    rs = llm.runner.stats
    stats.prefill_s, stats.decode_s, stats.compile_s = rs.prefill_s, rs.decode_s, rs.compile_s
    stats.decode_steps = rs.decode_steps
    stats.peak_memory_bytes = peak_memory_bytes(device)
    stats.extra["compiled_shapes"] = len(rs.shapes)
    stats.extra["prefix_tokens_saved"] = rs.prefix_tokens_saved
    stats.extra["quantization"] = llm.quant.to_dict()
    if nvml is not None:
        stats.extra.update(nvml.stop() or {})
    stats.finish()


def _progress(cfg: RunConfig, num_rows: int | None):
    # Rows done by an earlier run count as they are read past, so total is every input row.
    from tqdm.auto import tqdm

    total = num_rows if cfg.limit is None else min(cfg.limit, num_rows or cfg.limit)
    return tqdm(total=total, unit="row", disable=cfg.quiet, dynamic_ncols=True,
                desc="batchgen")  # fmt: skip
