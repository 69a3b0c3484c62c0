"""The step timeline: one row per engine step, kept in columns of machine numbers and written
as OUTPUT/.steps.parquet (atomically, at each flush and at the end) for `batchgen report`.

Recording a step appends ten numbers to ten `array`s (8 bytes each, no Python object per
value): about 1.5 us a step measured (docs/metrics.md), against steps of milliseconds, and
80 bytes a step of memory (a million steps, 80 MB). The file describes the last run of the
output directory, as .batchgen/stats.json does.
"""

from __future__ import annotations

from array import array
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine.sequence import StepReport

# column: (array typecode, arrow type, what it is)
COLUMNS = {
    "t_s": ("d", pa.float64(), "seconds since the job started, at the step's end"),
    "step_s": ("d", pa.float64(), "the step's model time (compile time where it compiled)"),
    "decode_rows": ("q", pa.int32(), "sequences that decoded one token"),
    "sampled_tokens": ("q", pa.int32(), "tokens sampled (decodes and prompts' first tokens)"),
    "prefill_tokens": ("q", pa.int32(), "prompt tokens computed"),
    "cached_tokens": ("q", pa.int32(), "prompt tokens found in the prefix cache"),
    "kv_blocks_used": ("q", pa.int32(), "KV blocks held by sequences after the step"),
    "kv_blocks_free": ("q", pa.int32(), "KV blocks free after the step"),
    "preemptions": ("q", pa.int32(), "sequences preempted by the step"),
    "waiting": ("q", pa.int32(), "sequences waiting after the step"),
}


class StepRecorder:
    def __init__(self, origin: float) -> None:
        """origin: time.perf_counter() at the job's start."""
        self.origin = origin
        self.cols = {name: array(code) for name, (code, _, _) in COLUMNS.items()}

    def __len__(self) -> int:
        return len(self.cols["t_s"])

    def add(self, r: StepReport) -> None:
        c = self.cols
        c["t_s"].append(r.at - self.origin)
        c["step_s"].append(r.seconds + r.compile_seconds)
        c["decode_rows"].append(r.decode_rows)
        c["sampled_tokens"].append(r.sampled)
        c["prefill_tokens"].append(r.prompt_tokens)
        c["cached_tokens"].append(r.cached_tokens)
        c["kv_blocks_used"].append(r.kv_blocks_used)
        c["kv_blocks_free"].append(r.kv_blocks_free)
        c["preemptions"].append(r.preempted)
        c["waiting"].append(r.waiting)

    def table(self) -> pa.Table:
        schema = pa.schema(
            [pa.field(n, t, metadata={"doc": d}) for n, (_, t, d) in COLUMNS.items()]
        )
        return pa.table(
            {n: pa.array(self.cols[n], type=schema.field(n).type) for n in COLUMNS}, schema=schema
        )

    def write(self, f: BinaryIO) -> None:
        pq.write_table(self.table(), f)
