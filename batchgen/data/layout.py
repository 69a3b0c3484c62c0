"""The layout of an output directory (which names in it are batchgen's), and moving an older
batchgen's into it.

The part files are the dataset, and everything else is under a
hidden name, so that pd.read_parquet(OUT), pyarrow.dataset.dataset(OUT), OUT/*.parquet and
datasets.load_dataset("parquet", data_dir=OUT) each read exactly the result rows (pyarrow skips
names starting with "." or "_", `datasets` only those starting with "." and folders with "__"):
    part-00000.parquet   results, each part written to a temp name, fsynced, then renamed
    part-00001.parquet   ...
    .batchgen/_lock      held (flock) by the one run writing the directory; holds its pid
    .batchgen/job.json   the job's fingerprint (input, model, options, and what the model
                         and input files were when it started); written first
    .batchgen/stats.json run statistics (throughput, timings, memory)
    .steps.parquet       one row per engine step of the last run (stats/steps.py)
    .batchgen/results.jsonl  OpenAI batch output lines (--output-format openai)
    .batchgen/report.html    `batchgen report`'s page, when asked for
    .batchgen/SUCCESS    written last, once every row has a result
    .batchgen/merged.parquet  a sharded job's rows in one file (`batchgen merge`, scaleout/merge.py)

Outputs of batchgen 0.1 (_job.json, _stats.json, _steps.parquet, _SUCCESS, _lock,
results.jsonl and report.html at the top) are moved into this layout when opened again.
"""

from __future__ import annotations

import logging
import os
import re

from batchgen.data.atomic import TMP_PREFIX, WriteFn, os_error, write_atomic
from batchgen.data.lock import LOCK_FILE, lock_directory
from batchgen.errors import InputError

log = logging.getLogger(__name__)

# Bookkeeping, as paths relative to the output directory (see the module doc).
META_DIR = ".batchgen"
JOB_FILE = f"{META_DIR}/job.json"
STATS_FILE = f"{META_DIR}/stats.json"
LOCK_PATH = f"{META_DIR}/{LOCK_FILE}"  # the one writer's flock (data/lock.py)
SUCCESS_FILE = f"{META_DIR}/SUCCESS"
# The error-rate verdict on the complete job, written just before SUCCESS and again by each
# rerun (runner/verdict.py): SUCCESS says every row is there, this says whether they pass.
VERDICT_FILE = f"{META_DIR}/verdict.json"
RESULTS_FILE = f"{META_DIR}/results.jsonl"  # OpenAI batch output lines (--output-format openai)
REPORT_FILE = f"{META_DIR}/report.html"  # `batchgen report`'s page
MERGED_FILE = f"{META_DIR}/merged.parquet"  # a sharded job's rows, by `batchgen merge`
# One row per engine step (stats/steps.py). At the top, hidden by its dot, not in META_DIR:
# runner/run.py and scaleout/merge_metrics.py write it with write_atomic(directory, STEPS_FILE).
STEPS_FILE = ".steps.parquet"
# The same files as older batchgens named them at the top of the output.
OLD_NAMES = {
    "_job.json": JOB_FILE,
    "_stats.json": STATS_FILE,
    "_steps.parquet": STEPS_FILE,
    "results.jsonl": RESULTS_FILE,
    "report.html": REPORT_FILE,
    "_SUCCESS": SUCCESS_FILE,  # last: a crash mid-move leaves the job incomplete, not wrong
}

PART_RE = re.compile(r"part-(\d+)\.parquet")  # the dataset's files; part_name(n) writes one
# What write_atomic's mkstemp names look like: TMP_PREFIX, the final name, "." and a random tail.
# Any other ".tmp-..." entry is not ours, so it is neither deleted nor taken as a sign of ownership.
TMP_RE = re.compile(
    rf"{re.escape(TMP_PREFIX)}(part-\d+\.parquet|job\.json|stats\.json|\.?_?steps\.parquet"
    r"|SUCCESS|verdict\.json|results\.jsonl|report\.html|_job\.json|_stats\.json|_SUCCESS)\.\w+"
)


def part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


def is_ours(name: str) -> bool:
    """A top-level name batchgen writes (today's or an older layout's)."""
    return (
        name in (META_DIR, STEPS_FILE, LOCK_FILE, *OLD_NAMES)
        or TMP_RE.fullmatch(name) is not None
        or PART_RE.fullmatch(name) is not None
    )


def write_file(directory: str | os.PathLike[str], name: str, write: WriteFn) -> None:
    """write_atomic for a path relative to `directory` (JOB_FILE, say), making its folder."""
    folder, base = os.path.split(os.path.join(os.fspath(directory), name))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise InputError(os_error(e, f"cannot create {folder}")) from None
    write_atomic(folder, base, write)


def migrate_old_layout(directory: str | os.PathLike[str]) -> None:
    """Move an older batchgen's bookkeeping (OLD_NAMES, at the top) into today's layout, under
    the old lock when there is one, so that its files no longer read as data."""
    directory = os.fspath(directory)
    names = os.listdir(directory)
    if not any(n in OLD_NAMES or n == LOCK_FILE for n in names):
        return
    old_lock = lock_directory(directory) if LOCK_FILE in names else None
    try:
        os.makedirs(os.path.join(directory, META_DIR), exist_ok=True)
        for old, new in OLD_NAMES.items():
            if old in names:
                log.warning("output %s: moving %s to %s", directory, old, new)
                os.replace(os.path.join(directory, old), os.path.join(directory, new))
        if old_lock is not None:
            os.remove(os.path.join(directory, LOCK_FILE))
    except OSError as e:
        raise InputError(os_error(e, f"cannot move {directory}'s files to this layout")) from None
    finally:
        if old_lock is not None:
            old_lock.close()
