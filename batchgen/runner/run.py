"""run(config): reader -> prepare -> engine -> writer, with stats alongside."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from contextlib import ExitStack, contextmanager

import torch

from batchgen.choices import OutputFormat
from batchgen.data import InputSource, OutputDir, PartBuffer
from batchgen.data.legacy_columns import rename_legacy_parts
from batchgen.data.openai_output import write_results
from batchgen.data.reader import OpenAIBatchSource
from batchgen.data.writer import RESULTS_FILE
from batchgen.errors import JobInterrupted
from batchgen.job.config import RunConfig
from batchgen.job.fingerprint import check_weights, job_fingerprint
from batchgen.job.open import Job, open_job
from batchgen.job.passthrough import legacy_renames
from batchgen.job.threads import cpu_threads
from batchgen.llm import LLM
from batchgen.runner.deadline import Watchdog, deadlines
from batchgen.runner.progress import ProgressLine, postfix, progress_bar
from batchgen.runner.rows import RunRows
from batchgen.runner.split import check_split
from batchgen.stats.latency import row_timings
from batchgen.stats.nvml import NvmlSampler
from batchgen.stats.peaks import resolve_peaks
from batchgen.stats.roofline import ModelCost
from batchgen.stats.run_stats import RunInfo, RunStats, peak_memory_bytes
from batchgen.stats.steps import clear_steps

log = logging.getLogger(__name__)


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


def run(cfg: RunConfig) -> RunStats:
    """Run one job to completion (or to a signal); returns its statistics."""
    # The output directory stays locked from its opening to the job's end, however it ends.
    # After a stop signal or a fatal error the process ends within seconds (deadline.py).
    with deadlines() as watchdog, ExitStack() as job_scope:
        try:
            return _run(cfg, job_scope, watchdog)
        except BaseException:
            watchdog.arm_fatal()  # the cleanup below gets seconds, not forever
            raise


def _run(cfg: RunConfig, job_scope: ExitStack, watchdog: Watchdog) -> RunStats:
    torch.set_num_threads(cfg.threads or cpu_threads())  # cpu_threads: affinity, cgroup quota
    job = open_job(cfg)
    cfg, spec, source, prep = job.cfg, job.spec, job.source, job.prep
    unsupported = getattr(source, "unsupported_fields", None) or None
    if unsupported:
        log.warning(
            "OpenAI batch body field(s) not supported, ignored: %s",
            ", ".join(f"{k} ({n} line{'s' * (n > 1)})" for k, n in unsupported.items()),
        )
    if source.num_rows == 0:  # a job of no rows completes: say why it wrote none
        log.warning("input %s has no rows: the job writes none", source.path)
    schema = prep.output_schema()  # checked before the output directory is touched
    check_split(cfg)  # a sharded run and an unsharded one are two jobs: not in one output
    out = job_scope.enter_context(OutputDir(cfg.output_dir, job_fingerprint(job), cfg.overwrite))
    rename_legacy_parts(out, legacy_renames(cfg, source, prep.id_column))  # `text`, pre-0.5
    shape = prep.record_shape
    done = out.done_ids(shape.id_column)  # ids, or (id, sample_index) pairs with samples
    stats = RunStats(
        rows_skipped_done=len(done),
        openai_unsupported_fields=unsupported,
        generation_defaults=job.generation.to_dict(),
    )
    if out.is_complete:
        log.warning(
            "%s already holds this job's complete results; --overwrite reruns it", cfg.output_dir
        )
        if cfg.output_format is OutputFormat.OPENAI:  # the part files may predate the option
            _write_openai_results(out, job)
        stats.verdict = out.record_verdict(cfg.max_error_rate)  # this rerun's --max-error-rate
        stats.finish(complete=True)
        return stats

    longest = _job_longest_row(job, done)
    t0 = time.perf_counter()
    llm = job_scope.enter_context(LLM.from_spec(spec))  # closed (its ranks ended) at the end
    check_weights(out, llm.quant.to_dict())  # what the weights became, before any row is added
    if longest is not None:  # a pool sized for every row, not only the first window's
        llm.engine.reserve(longest)
    info = _run_info(llm)
    load_s = time.perf_counter() - t0
    tp = spec.tensor_parallel_size
    peaks = resolve_peaks(spec.device, spec.dtype, cfg.peak_tflops, cfg.peak_bandwidth_gbs, tp)
    stats.loaded(info, load_s, _model_cost(llm, info), peaks)
    # The model, quantization scheme and adapter travel with every part file, not only stats.json.
    meta = {"model": info.model, "dtype": info.dtype, "quantization": info.quantization}
    meta["id_column"] = shape.id_column
    if info.lora is not None:
        meta["lora"] = info.lora
    schema = schema.with_metadata({"batchgen": json.dumps(meta)})
    device = spec.device
    # every rank's GPU: rank r of a tensor-parallel job runs on cuda:r (parallel/rank_model.py)
    gpus = range(tp) if tp > 1 else [device.index or 0]
    nvml = NvmlSampler(gpus).start() if device.type == "cuda" else None
    clear_steps(out.path)  # the timeline is this run's, as stats.json will be
    buffer = PartBuffer(out, cfg.rows_per_part, schema)
    progress = progress_bar(cfg, source.num_rows, prep.records_per_row)
    log_line = ProgressLine(cfg.progress_seconds)

    def timings(c) -> dict | None:
        return row_timings(c, stats.started) if shape.with_timings else None

    rows = RunRows(shape, buffer, stats, progress, prep.as_list, timings)

    def flush(final: bool = False) -> None:
        """The finished rows into a part file (final: the job's last, an empty one if it has
        no rows), and the step timeline so far."""
        buffer.flush(final=final)
        stats.timeline.append_to(out.path)  # the steps since the last flush, as one part

    last_flush = time.monotonic()
    complete = False
    # Signals stay deferred until the results are flushed and marked: a SIGTERM during the
    # last writes cannot leave a finished job looking unfinished.
    with _stop_on_signals() as signals:
        try:
            for report in llm.engine.generate(rows.requests(prep.windows(done))):
                stats.add_step(report)  # its cost and its finished rows
                if report.finished:
                    rows.finish(report.finished)
                    progress.set_postfix_str(postfix(stats, report), refresh=False)
                    log_line.maybe(progress, stats)
                if time.monotonic() - last_flush > cfg.flush_seconds:
                    flush()
                    last_flush = time.monotonic()
                if signals:
                    raise JobInterrupted(signals[0])
            if rows.pending_lists:  # cannot happen: every sample finishes
                raise RuntimeError(f"{rows.pending_lists} rows still wait for samples at the end")
            complete = True
        except BaseException:
            watchdog.arm_fatal()  # the flush below gets seconds, not forever
            raise
        finally:
            flush(final=complete)  # on a signal too: every finished row is kept
            progress.close()
            gpu = nvml.stop() if nvml is not None else None
            stats.finish(complete, peak_memory_bytes(device), llm.engine.kv_pool, gpu)
            out.write_stats(stats.to_dict())
        if cfg.output_format is OutputFormat.OPENAI:
            _write_openai_results(out, job)
        stats.verdict = out.record_verdict(cfg.max_error_rate)
        out.mark_success()
    return stats


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


def _model_cost(llm: LLM, info: RunInfo) -> ModelCost:
    """What the job's tokens cost (stats/roofline.py). A decode step reads every weight but
    the input embedding, a gather of a few rows (unless it is also the LM head)."""
    cfg, dtype_bytes = llm.spec.model_cfg, llm.spec.dtype.itemsize
    weights = info.weights_bytes_per_rank * info.tensor_parallel_size
    if not cfg.tie_embeddings:
        weights -= cfg.vocab_size * cfg.dim * dtype_bytes
    return ModelCost.from_config(cfg, dtype_bytes, weights)


def _write_openai_results(out: OutputDir, job: Job) -> None:
    source: InputSource = job.source
    assert isinstance(source, OpenAIBatchSource)  # checked in open_job
    tokenizer = job.spec.tokenizer

    def token_text(t: int) -> str:
        return tokenizer.decode([t])

    model = str(job.spec.model_dir)
    # -o results.jsonl: that file; else OUT/.batchgen/results.jsonl
    folder, name = os.path.split(job.cfg.results_path or os.path.join(out.path, RESULTS_FILE))
    requests, results, eos = source.requests, out.read_all(), job.spec.eos_ids
    n = write_results(folder, requests, results, model, token_text, eos_ids=eos, name=name)
    log.info("wrote %d OpenAI batch output lines to %s", n, os.path.join(folder, name))


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
