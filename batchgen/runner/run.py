"""run(config): reader -> prepare -> engine -> writer, with stats alongside.

The engine steps on this thread; the next window is read and prepared on a reader thread and
the parts are written on a writer thread (background.py, sink.py), so neither holds a step."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from contextlib import ExitStack, contextmanager

import torch

from batchgen.choices import OutputFormat
from batchgen.data import InputSource, OutputDir
from batchgen.data.legacy_columns import rename_legacy_parts
from batchgen.data.openai_output import write_results
from batchgen.data.reader import OpenAIBatchSource
from batchgen.data.writer import RESULTS_FILE
from batchgen.errors import JobInterrupted
from batchgen.job.config import RunConfig
from batchgen.job.fingerprint import job_fingerprint
from batchgen.job.open import Job, open_job
from batchgen.job.passthrough import legacy_renames
from batchgen.job.prepare import Window
from batchgen.job.threads import ThreadGovernor, cpu_threads, governable
from batchgen.llm import LLM
from batchgen.runner.background import Prefetch
from batchgen.runner.deadline import Watchdog, deadlines
from batchgen.runner.load import gpu_sampler, load_model, part_metadata
from batchgen.runner.progress import Progress
from batchgen.runner.rows import RunRows
from batchgen.runner.sink import ResultSink
from batchgen.runner.split import check_split
from batchgen.stats.run_stats import RunStats, peak_memory_bytes
from batchgen.stats.steps import clear_steps

log = logging.getLogger(__name__)

# Windows read, rendered and tokenized ahead of the engine (each --window-rows rows, 8192 by
# default): the next one is made while the engine takes this one's requests.
READ_AHEAD_WINDOWS = 1


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
    governor = _thread_governor(job)
    cfg, prep = job.cfg, job.prep
    unsupported = _warn_about_input(job)
    schema = prep.output_schema()  # checked before the output directory is touched
    check_split(cfg)  # a sharded run and an unsharded one are two jobs: not in one output
    out = job_scope.enter_context(OutputDir(cfg.output_dir, job_fingerprint(job), cfg.overwrite))
    rename_legacy_parts(out, legacy_renames(cfg, job.source, prep.id_column))  # `text`, pre-0.5
    shape = prep.record_shape
    done = out.done_ids(shape.id_column)  # ids, or (id, sample_index) pairs with samples
    stats = RunStats(
        rows_skipped_done=len(done),
        openai_unsupported_fields=unsupported,
        generation_defaults=job.generation.to_dict(),
    )
    if out.is_complete:
        return _complete_already(job, out, stats)

    llm = load_model(job, out, done, stats, job_scope)
    schema = schema.with_metadata(part_metadata(stats.info, shape.id_column))
    nvml = gpu_sampler(llm)
    clear_steps(out.path)  # the timeline is this run's, as stats.json will be
    progress = Progress(cfg, job.source.num_rows, prep.records_per_row)
    sink = ResultSink(out, cfg.rows_per_part, schema, stats.timeline, cfg.flush_seconds)
    rows = RunRows(shape, sink, stats, progress)
    complete = False
    # Signals stay deferred until the results are written and marked: a SIGTERM during the
    # last writes cannot leave a finished job looking unfinished.
    with _stop_on_signals() as signals, sink:
        try:
            with Prefetch(prep.windows(done), READ_AHEAD_WINDOWS, "batchgen-read-ahead") as windows:
                _generate(llm, rows, windows, sink, signals, governor)
            complete = True
        except BaseException:
            watchdog.arm_fatal()  # the writes below get seconds, not forever
            raise
        finally:
            sink.close(complete)  # on a signal too: every finished row is kept, written once
            progress.close()
            gpu = nvml.stop() if nvml is not None else None
            stats.threads = _threads_summary(governor)
            stats.finish(complete, peak_memory_bytes(job.spec.device), llm.engine.kv_pool, gpu)
            out.write_stats(stats.to_dict())
        if cfg.output_format is OutputFormat.OPENAI:
            _write_openai_results(out, job)
        stats.verdict = out.record_verdict(cfg.max_error_rate)
        out.mark_success()  # every part is durable: sink.close waited for the writer
    return stats


def _generate(
    llm: LLM,
    rows: RunRows,
    windows: Iterable[tuple[int, Window]],
    sink: ResultSink,
    signals: list[int],
    governor: ThreadGovernor | None = None,
) -> None:
    """The step loop: each step's finished rows counted and written, a part at least every
    --flush-seconds, a stop between steps once a signal came, the thread count fitted to the
    CPUs other processes leave."""
    for report in llm.engine.generate(rows.requests(windows)):
        rows.step(report)
        sink.tick()
        if governor is not None:
            governor.tick()
        if signals:
            raise JobInterrupted(signals[0])
    if rows.pending_lists:  # cannot happen: every sample finishes
        raise RuntimeError(f"{rows.pending_lists} rows still wait for samples at the end")


def _thread_governor(job: Job) -> ThreadGovernor | None:
    """Threads that follow what other processes leave of the CPUs, for a job whose model may
    (threads.governable) and whose thread count the user did not set (--threads fixes it)."""
    if job.cfg.threads or not governable(job.spec):
        return None
    return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)


def _threads_summary(governor: ThreadGovernor | None) -> dict[str, int]:
    if governor is not None:
        return governor.summary()
    n = torch.get_num_threads()
    return {"start": n, "fewest": n, "last": n, "changes": 0}


def _warn_about_input(job: Job) -> dict[str, int] | None:
    """Warn of an input's ignored OpenAI body fields (returned, by lines) or of no rows."""
    source = job.source
    unsupported = getattr(source, "unsupported_fields", None) or None
    if unsupported:
        log.warning(
            "OpenAI batch body field(s) not supported, ignored: %s",
            ", ".join(f"{k} ({n} line{'s' * (n > 1)})" for k, n in unsupported.items()),
        )
    if source.num_rows == 0:  # a job of no rows completes: say why it wrote none
        log.warning("input %s has no rows: the job writes none", source.path)
    return unsupported


def _complete_already(job: Job, out: OutputDir, stats: RunStats) -> RunStats:
    """A rerun of a complete job: nothing to run; the verdict under this run's options."""
    log.warning(
        "%s already holds this job's complete results; --overwrite reruns it", job.cfg.output_dir
    )
    if job.cfg.output_format is OutputFormat.OPENAI:  # the part files may predate the option
        _write_openai_results(out, job)
    stats.verdict = out.record_verdict(job.cfg.max_error_rate)  # this rerun's --max-error-rate
    stats.finish(complete=True)
    return stats


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
