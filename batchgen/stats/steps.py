"""The step timeline: one row per engine step, kept in columns of machine numbers and written
for `batchgen report` as OUTPUT/.batchgen/steps/steps-NNNNN.pq (Parquet files named so that no
reader's `*.parquet` glob takes them for rows, data/layout.py): each flush appends the steps
since the last as one part (rewriting the whole timeline at every flush was quadratic in a long
job's length). A merge writes the shards' on one clock as OUTPUT/.batchgen/steps.pq. Outputs of
earlier versions held it as .batchgen/steps/part-NNNNN.parquet or OUTPUT/.steps.parquet, which
`read_steps` still reads (and opening the output renames).

Recording a step appends twelve numbers to twelve `array`s (8 bytes each, no Python object
per value): about 1.5 us a step measured (docs/metrics.md), against steps of milliseconds, and
under 100 bytes a step of memory until the step is taken for a part (`take_part`): a flush
interval's steps, not the job's. The timeline describes the last run of the output directory,
as .batchgen/stats.json does: a run starts it anew (`clear_steps`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from array import array
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.layout import (
    OLD_STEPS_PART_RE,
    STEPS_DIR,
    STEPS_FILE,
    STEPS_PART_RE,
    steps_part_name,
    write_file,
)
from batchgen.engine.sequence import StepReport

OLD_STEPS_FILE = ".steps.parquet"  # an earlier batchgen's merged timeline, at the top

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
    "compiled": ("b", pa.bool_(), "the step's forward ran the compiled graph"),
    "host_gap_s": ("d", pa.float64(), "the host's time since the last step ended (NaN: first)"),
}


class StepRecorder:
    def __init__(self, origin: float) -> None:
        """origin: time.perf_counter() at the job's start."""
        self.origin = origin
        self.cols = {name: array(code) for name, (code, _, _) in COLUMNS.items()}  # unwritten
        self.written = 0  # steps taken for part files (and dropped from cols)
        self.parts = 0

    def __len__(self) -> int:
        """Steps recorded and not yet taken for a part: what the recorder holds."""
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
        c["compiled"].append(r.compiled)
        gap = r.host_gap_seconds
        c["host_gap_s"].append(float("nan") if gap is None else gap)

    def table(self) -> pa.Table:
        """The steps held (not yet taken for a part)."""
        schema = pa.schema(
            [pa.field(n, t, metadata={"doc": d}) for n, (_, t, d) in COLUMNS.items()]
        )
        cols = {n: self._column(n, schema.field(n).type) for n in COLUMNS}
        return pa.table(cols, schema=schema)

    def _column(self, name: str, kind: pa.DataType) -> pa.Array:
        values = self.cols[name]
        return pa.array([bool(v) for v in values] if kind == pa.bool_() else values, type=kind)

    def take_part(self, directory: str | os.PathLike[str]) -> Callable[[], None] | None:
        """The steps recorded since the last call, taken now, and the write of them as the
        next part of directory's timeline (atomically, as every file of an output directory),
        to run later (on the run's writer thread, while this goes on recording); None: no new
        steps. The steps taken leave memory: the recorder holds a flush interval's steps, not
        the job's (a long job's 80 bytes a step, kept to its end, were most of its growth)."""
        if not len(self):
            return None
        table = self.table()
        for values in self.cols.values():
            del values[:]
        name = f"{STEPS_DIR}/{steps_part_name(self.parts)}"
        self.written, self.parts = self.written + table.num_rows, self.parts + 1
        return lambda: write_file(directory, name, lambda f: pq.write_table(table, f))


def clear_steps(directory: str | os.PathLike[str]) -> None:
    """Drop an earlier run's timeline (its parts, or an older batchgen's single file)."""
    shutil.rmtree(os.path.join(directory, STEPS_DIR), ignore_errors=True)
    for name in (STEPS_FILE, OLD_STEPS_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, name))


def steps_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The timeline's files in order: its parts, or the single file of an older batchgen or a
    merge; [] where there is none."""
    folder = Path(directory) / STEPS_DIR
    found = {
        int(m.group(1)): p
        for p in (folder.iterdir() if folder.is_dir() else ())
        if (m := STEPS_PART_RE.fullmatch(p.name) or OLD_STEPS_PART_RE.fullmatch(p.name))
    }
    parts = [found[k] for k in sorted(found)]
    single = [Path(directory) / n for n in (STEPS_FILE, OLD_STEPS_FILE)]
    return parts or [p for p in single if p.exists()][:1]


def read_steps(directory: str | os.PathLike[str]) -> pa.Table | None:
    """The timeline as one table; None where there is none. Arrow and OS errors pass on."""
    files = steps_files(directory)
    if not files:
        return None
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
