"""Where a run's records go: the part buffer, the step timeline beside it, and the writer
thread that writes both while the engine steps.

The engine's thread only cuts records into parts (and the timeline's new steps into a table);
building each part's Arrow table and writing it (atomically, fsynced) is the writer's, at most
WRITE_DEPTH parts behind: a slower disk holds the engine back there, never more rows than
that. The parts keep their order and numbers. `close` writes what is left (on a signal or an
error too: every finished row is kept, once) and returns only when every part is durable, so
SUCCESS, written after it, never precedes one; a failed write is raised on the engine's thread
(at the next part handed over, at the latest at `close`) and fails the job, as a write on the
engine's thread did.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from batchgen.data import OutputDir, PartBuffer
from batchgen.runner.background import SerialWorker
from batchgen.stats.steps import StepRecorder

WRITE_DEPTH = 2  # parts (or timeline parts) handed over and not yet written


class ResultSink:
    def __init__(
        self,
        out: OutputDir,
        rows_per_part: int,
        schema: pa.Schema,
        timeline: StepRecorder,
        flush_seconds: float,
    ) -> None:
        self.out, self.timeline, self.flush_seconds = out, timeline, flush_seconds
        self._writer = SerialWorker(WRITE_DEPTH, name="batchgen-writer")
        self.buffer = PartBuffer(out, rows_per_part, schema, write=self._hand_over)
        self._last_flush = time.monotonic()

    def __enter__(self) -> ResultSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._writer.close()  # the thread ends, whatever happened before

    def add(self, records: list[dict[str, Any]]) -> None:
        """Finished records: a part handed to the writer whenever rows_per_part are in."""
        self.buffer.add(records)

    def tick(self) -> None:
        """Between steps: the rows held and the timeline written at least every
        flush_seconds, bounding the work a kill loses."""
        if time.monotonic() - self._last_flush > self.flush_seconds:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """The rows held as a part (final: the job's last, an empty one if it has no rows),
        and the step timeline so far as one timeline part."""
        self.buffer.flush(final=final)
        write_steps = self.timeline.take_part(self.out.path)
        if write_steps is not None:
            self._writer.submit(write_steps)
        self._last_flush = time.monotonic()

    def close(self, complete: bool) -> None:
        """The last flush, then wait until every part is written (raising a failed write)."""
        try:
            self.flush(final=complete)
        finally:
            self._writer.close()

    def _hand_over(self, rows: list[dict[str, Any]]) -> None:
        self._writer.submit(lambda: self.buffer.write_part(rows))
