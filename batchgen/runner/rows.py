"""A run's rows from the prepared windows to the written records: the one place where rows are
written and counted.

Each window's error rows are written as read; its requests go to the engine under indices of
one stream, and each finished completion comes back to its row here, becomes a record, goes
to the result sink (sink.py; with --n-as-list, a row's record once all its samples are in)
and is counted, as a record, in the stats (rows, error reasons) and the progress bar."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from batchgen.data.records import RecordShape, Row
from batchgen.data.sample_lists import SampleLists
from batchgen.engine.constraints import as_written
from batchgen.engine.sequence import Completion, Constraint, Request, StepReport
from batchgen.job.prepare import Window
from batchgen.runner.progress import Progress
from batchgen.runner.sink import ResultSink
from batchgen.stats.latency import row_timings
from batchgen.stats.run_stats import RunStats


class RunRows:
    def __init__(
        self, shape: RecordShape, sink: ResultSink, stats: RunStats, progress: Progress
    ) -> None:
        self.shape, self.sink, self.stats, self.progress = shape, sink, stats, progress
        self.lists = SampleLists() if shape.as_list else None
        self._rows: dict[int, Row] = {}  # rows in flight, by request index
        self._choices: dict[int, Constraint] = {}  # their constraints (a label as written)
        self._n = 0

    def requests(self, windows: Iterable[tuple[int, Window]]) -> Iterator[Request]:
        """Every window's requests as one stream; its error rows are written as read."""
        for _, window in windows:
            errors = window.errors
            self._write(errors, [self.shape.record(r, None) for r in errors])
            self.progress.update(window.skipped)
            for r in window.requests:
                self._rows[self._n] = window.rows[r.index]
                if r.params.constraint is not None:
                    self._choices[self._n] = r.params.constraint
                yield dataclasses.replace(r, index=self._n)
                self._n += 1

    def step(self, report: StepReport) -> None:
        """One engine step: its cost and its finished rows counted, their records written."""
        self.stats.add_step(report)
        if report.finished:
            self.finish(report.finished)
            self.progress.finished(self.stats, report)

    def finish(self, completions: list[Completion]) -> None:
        """The engine finished these requests: their records written and counted."""
        rows = [self._rows.pop(c.index) for c in completions]
        for c in completions:
            c.text = as_written(self._choices.pop(c.index, None), c.text)
        pairs = zip(rows, completions, strict=True)
        self._write(rows, [self.shape.record(r, c, self._timings(c)) for r, c in pairs])

    @property
    def pending_lists(self) -> int:
        """--n-as-list rows with some but not all samples in."""
        return self.lists.pending if self.lists is not None else 0

    def _write(self, rows: list[Row], records: list[dict]) -> None:
        """Samples' records into the part buffer, counted as records (--n-as-list: a row's
        one record, once its last sample is in)."""
        if self.lists is not None:
            lists, pairs = self.lists, zip(rows, records, strict=True)
            gathered = (lists.add(r.id, r.num_samples, r.sample_index, rec) for r, rec in pairs)
            records = [rec for rec in gathered if rec is not None]
        self.stats.add_records(records)
        self.progress.update(len(records))
        self.sink.add(records)

    def _timings(self, c: Completion) -> dict | None:
        return row_timings(c, self.stats.started) if self.shape.with_timings else None
