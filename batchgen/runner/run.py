"""run(config): reader -> prepare -> engine -> writer, with stats alongside."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from batchgen.choices import OutputFormat, Task
from batchgen.data import InputSource, OutputDir, PartBuffer, output_schema
from batchgen.data.openai_output import write_results
from batchgen.data.reader import OpenAIBatchSource
from batchgen.data.records import SampleLists
from batchgen.data.writer import RESULTS_FILE
from batchgen.engine.sequence import Completion, FinishReason, Request
from batchgen.errors import JobInterrupted
from batchgen.job.config import RunConfig
from batchgen.job.fingerprint import content_fingerprint
from batchgen.job.open import open_job
from batchgen.job.prepare import Row
from batchgen.llm import LLM
from batchgen.stats.nvml import NvmlSampler
from batchgen.stats.run_stats import RunStats, peak_memory_bytes

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


def _row_record(row: Row, c: Completion | None, cfg: RunConfig, id_column: str) -> dict[str, Any]:
    """The output record of a row: its completion, or its error (c None or c.error set)."""
    ok = c is not None and c.error is None
    rec = {id_column: row.id, **row.passthrough}
    if row.sample_index is not None:
        rec["sample_index"] = row.sample_index
    if cfg.task is Task.SCORE:  # the labels' probabilities, normalised over them
        probs = _normalise(c.scores) if ok else None
        rec["label"] = row.labels[probs.index(max(probs))] if ok else None
        rec["scores"] = list(zip(row.labels, probs, strict=True)) if ok else None
    else:
        rec["text"] = c.text if ok else None
    rec.update(
        finish_reason=c.finish_reason.value if ok else FinishReason.ERROR.value,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=c.completion_tokens if ok else 0,
        error=None if ok else (c.error if c is not None else row.error),
    )
    if cfg.with_token_ids:
        rec["token_ids"] = c.token_ids if ok else None
    if cfg.with_logprobs:
        rec["logprobs"] = c.logprobs if ok else None
    return rec


def _normalise(logprobs: list[float]) -> list[float]:
    """log P(label | prompt) per label -> P(label | prompt, one of the labels)."""
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


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
    if cfg.output_format is OutputFormat.OPENAI and job.source.asks_logprobs:
        # the output lines that ask for them get each token's logprob: the parts keep them
        cfg = dataclasses.replace(cfg, with_token_ids=True, with_logprobs=True)
    if isinstance(job.source, OpenAIBatchSource) and job.source.unsupported_fields:
        unsupported = job.source.unsupported_fields
        stats.extra["openai_unsupported_fields"] = unsupported
        log.warning(
            "OpenAI batch body field(s) not supported, ignored: %s",
            ", ".join(f"{k} ({n} line{'s' * (n > 1)})" for k, n in unsupported.items()),
        )
    spec, source, prep = job.spec, job.source, job.prep
    model_dir, device = spec.model_dir, spec.device
    passthrough = pa.schema([source.schema.field(c) for c in prep.passthrough])
    id_column = prep.output_id_column
    schema = output_schema(
        prep.id_type,
        passthrough,
        cfg.with_token_ids,
        cfg.with_logprobs,
        samples=prep.samples,
        id_column=id_column,
        score=prep.score,
        as_list=prep.as_list,
    )
    # The id column as resolved (an input's `id` column is one without --id-column).
    fingerprint = {
        **cfg.fingerprint(),
        "id_column": prep.id_column,
        **content_fingerprint(model_dir, source),
    }
    out = job_scope.enter_context(OutputDir(cfg.output_dir, fingerprint, cfg.overwrite))
    done = out.done_ids(id_column)  # ids, or (id, sample_index) pairs with samples
    stats.rows_skipped_done = len(done)
    if out.is_complete:
        log.warning(
            "%s already holds this job's complete results; --overwrite reruns it", cfg.output_dir
        )
        stats.extra["complete"] = True
        if cfg.output_format is OutputFormat.OPENAI:  # the part files may predate the option
            _write_openai_results(out, source, model_dir, spec.tokenizer)
        stats.finish()
        return stats

    t0 = time.perf_counter()
    llm = LLM.from_spec(spec)
    stats.load_s = time.perf_counter() - t0
    stats.extra.update(
        model=str(model_dir),
        family=spec.model_cfg.family.value,
        device=str(device),
        dtype=str(spec.dtype).removeprefix("torch."),
        compiled=spec.compile,
        max_num_seqs=spec.engine.max_num_seqs,
        max_num_batched_tokens=spec.engine.max_num_batched_tokens,
        block_size=spec.engine.block_size,
        prefix_caching=spec.engine.prefix_caching,
    )
    # The model, quantization scheme and adapter travel with every part file, not only _stats.json.
    meta = {
        "model": str(model_dir),
        "dtype": stats.extra["dtype"],
        "quantization": llm.quant.to_dict(),
        "id_column": id_column,
    }
    if llm.lora is not None:
        stats.extra["lora"] = meta["lora"] = llm.lora.to_dict()
    schema = schema.with_metadata({"batchgen": json.dumps(meta)})
    nvml = NvmlSampler(device.index or 0).start() if device.type == "cuda" else None
    buffer = PartBuffer(out, cfg.rows_per_part, schema)
    progress = _progress(cfg, source.num_rows)
    rows: dict[int, Row] = {}  # rows in flight, by request index
    lists = SampleLists() if prep.as_list else None

    def gather(finished: list[Row], records: list[dict]) -> list[dict]:
        """The records to write: as they are, or (--n-as-list) each row's once all its
        samples are in."""
        if lists is None:
            return records
        out = (lists.add(r.id, r.num_samples, r.sample_index, rec) for r, rec in zip(finished, records, strict=True))  # fmt: skip
        return [rec for rec in out if rec is not None]

    def requests() -> Iterator[Request]:
        """Every row not done yet, as one stream; error rows are written as read."""
        n = 0
        for _, window in prep.windows(done):
            errors = [_row_record(r, None, cfg, id_column) for r in window.errors]
            buffer.add(gather(window.errors, errors))
            stats.add_error_rows(len(errors))
            progress.update(window.skipped + len(errors))
            for r in window.requests:
                rows[n] = window.rows[r.index]
                yield dataclasses.replace(r, index=n)
                n += 1

    last_flush = time.monotonic()
    complete = False
    # Signals stay deferred until the results are flushed and marked: a SIGTERM during the
    # last writes cannot leave a finished job looking unfinished.
    with _stop_on_signals() as signals:
        try:
            for report in llm.engine.generate(requests()):
                stats.add_step(report)  # its cost and its finished rows
                if report.finished:
                    done_now = report.finished
                    finished = [rows.pop(c.index) for c in done_now]
                    records = [_row_record(r, c, cfg, id_column) for r, c in zip(finished, done_now, strict=True)]  # fmt: skip
                    buffer.add(gather(finished, records))
                    progress.update(len(done_now))
                    progress.set_postfix_str(f"{stats.rate(stats.output_tokens):.0f} out tok/s")
                if time.monotonic() - last_flush > cfg.flush_seconds:
                    buffer.flush()
                    last_flush = time.monotonic()
                if signals:
                    raise JobInterrupted(signals[0])
            if lists is not None and lists.pending:  # cannot happen: every sample finishes
                raise RuntimeError(f"{lists.pending} rows still wait for samples at the end")
            complete = True
        finally:
            buffer.flush()  # on a signal too: every finished row is kept
            progress.close()
            _finish_stats(stats, llm, device, nvml)
            stats.extra["complete"] = complete
            out.write_stats(stats.to_dict())
        if cfg.output_format is OutputFormat.OPENAI:
            _write_openai_results(out, source, model_dir, spec.tokenizer)
        out.mark_success()
    return stats


def _write_openai_results(out: OutputDir, source: InputSource, model_dir: Path, tokenizer) -> None:  # fmt: skip
    assert isinstance(source, OpenAIBatchSource)  # checked in open_job

    def token_text(t: int) -> str:
        return tokenizer.decode([t])

    n = write_results(out.path, source.requests, out.read_all(), str(model_dir), token_text)
    log.info("wrote %d OpenAI batch output lines to %s", n, os.path.join(out.path, RESULTS_FILE))


def _finish_stats(
    stats: RunStats, llm: LLM, device: torch.device, nvml: NvmlSampler | None
) -> None:
    stats.peak_memory_bytes = peak_memory_bytes(device)
    sched = llm.engine.scheduler
    if sched is not None:
        pool = sched.pool
        stats.extra.update(
            kv_cache_tokens=pool.num_usable * pool.block_size,
            kv_cache_bytes=pool.num_blocks * llm.runner.kv_bytes_per_block(),
            prefix_cache_hit_rate=pool.hits / pool.queries if pool.queries else 0.0,
        )
    stats.extra["compiled_shapes"] = len(llm.runner.shapes)
    stats.extra["quantization"] = llm.quant.to_dict()
    if nvml is not None:
        stats.extra.update(nvml.stop() or {})
    stats.finish()


def _progress(cfg: RunConfig, num_rows: int | None):
    # Rows done by an earlier run count as they are read past, so total is every input row.
    from tqdm.auto import tqdm

    total = num_rows if cfg.limit is None else min(cfg.limit, num_rows or cfg.limit)
    total = total * cfg.n if total is not None else None  # records (an n column: approximate)
    return tqdm(total=total, unit="row", disable=cfg.quiet, dynamic_ncols=True,
                desc="batchgen")  # fmt: skip
