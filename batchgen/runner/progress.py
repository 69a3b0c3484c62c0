"""A running job's progress: the bar on a terminal, a plain line every few seconds where
stderr is no terminal (Slurm logs, pipes)."""

from __future__ import annotations

import os
import sys
import time

from batchgen.job.config import RunConfig
from batchgen.stats.run_stats import RunStats


def postfix(stats: RunStats, report) -> str:
    """The progress bar's: output tokens/s, the KV cache in use and the error rows."""
    used, free = report.kv_blocks_used, report.kv_blocks_free
    kv = f", KV {used / (used + free):.0%}" if used + free else ""
    return f"{stats.rate(stats.output_tokens):.0f} out tok/s{kv}, {stats.error_records} errors"


class ProgressLine:
    """Where stderr is no terminal (a Slurm log, a pipe), a plain line every `seconds` in place
    of the bar (which --quiet or a log would lose): rows done/total, out tok/s, ETA, errors,
    as vLLM's periodic stats do. BATCHGEN_PROGRESS_SECONDS overrides (tests)."""

    def __init__(self, seconds: float) -> None:
        seconds = float(os.environ.get("BATCHGEN_PROGRESS_SECONDS", seconds))
        self.seconds = seconds if seconds > 0 and not sys.stderr.isatty() else 0.0
        self.last = time.monotonic()

    def maybe(self, bar, stats: RunStats) -> None:
        if not self.seconds or time.monotonic() - self.last < self.seconds:
            return
        self.last = time.monotonic()
        done, total = stats.rows + stats.rows_skipped_done, bar.total  # bar.n: 0 if disabled
        rate = stats.rate(stats.rows)
        eta = f"{(total - done) / rate:.0f} s" if total and rate > 0 else "?"
        print(
            f"batchgen: {done}/{total if total is not None else '?'} rows, "
            f"{stats.rate(stats.output_tokens):.1f} out tok/s, ETA {eta}, "
            f"{stats.error_records} errors",
            file=sys.stderr,
            flush=True,
        )


class Progress:
    """The bar, and the plain line off a terminal: records counted as written."""

    def __init__(self, cfg: RunConfig, num_rows: int | None, records_per_row: int) -> None:
        self.bar = progress_bar(cfg, num_rows, records_per_row)
        self.line = ProgressLine(cfg.progress_seconds)

    def update(self, records: int) -> None:
        self.bar.update(records)

    def finished(self, stats: RunStats, report) -> None:
        """A step finished rows (already counted in stats)."""
        self.bar.set_postfix_str(postfix(stats, report), refresh=False)
        self.line.maybe(self.bar, stats)

    def close(self) -> None:
        self.bar.close()


def progress_bar(cfg: RunConfig, num_rows: int | None, records_per_row: int):
    """Counts records, as stats.json's rows do: records_per_row for each input row (--n; an n
    column: approximate; one with --n-as-list). Records done by an earlier run count as they
    are read past, so total is every input row's."""
    from tqdm.auto import tqdm

    total = num_rows if cfg.limit is None else min(cfg.limit, num_rows or cfg.limit)
    total = total * records_per_row if total is not None else None
    return tqdm(total=total, unit="row", disable=cfg.quiet, dynamic_ncols=True, desc="batchgen")
