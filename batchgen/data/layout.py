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
    .batchgen/steps/     one row per engine step of the last run, a part per flush
                         (stats/steps.py); .batchgen/steps.pq after a merge
    .batchgen/results.jsonl  OpenAI batch output lines (--output-format openai)
    .batchgen/report.html    `batchgen report`'s page, when asked for
    .batchgen/SUCCESS    written last, once every row has a result
    .batchgen/merged.pq  a sharded job's rows in one Parquet file (`batchgen merge`,
                         scaleout/merge.py)
No file but the parts ends in ".parquet" (see MERGED_FILE).

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
# rerun (data/verdict.py): SUCCESS says every row is there, this says whether they pass.
VERDICT_FILE = f"{META_DIR}/verdict.json"
RESULTS_FILE = f"{META_DIR}/results.jsonl"  # OpenAI batch output lines (--output-format openai)
REPORT_FILE = f"{META_DIR}/report.html"  # `batchgen report`'s page
# No file but the result parts ends in ".parquet": DuckDB's globs match hidden names, so
# OUT/*/*.parquet and OUT/**/*.parquet would read any other (the step timeline, or a merged copy
# of the shards' rows) as rows. These are Parquet files under another suffix (".pq").
MERGED_FILE = f"{META_DIR}/merged.pq"  # a sharded job's rows in one file, by `batchgen merge`
SLURM_DIR = f"{META_DIR}/slurm"  # `batchgen slurm`'s script and the array tasks' logs
# A run's step timeline: a part per flush (stats/steps.py), steps_part_name(n).
STEPS_DIR = f"{META_DIR}/steps"
STEPS_PART_RE = re.compile(r"steps-(\d+)\.pq")
OLD_STEPS_PART_RE = re.compile(r"part-(\d+)\.parquet")  # an earlier batchgen's
# A merged job's step timeline in one file (scaleout/merge_metrics.py); a run's is in parts
# (stats/steps.py).
STEPS_FILE = f"{META_DIR}/steps.pq"
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
SHARD_DIR_RE = re.compile(r"shard-\d{5}-of-\d{5}")  # a shard's folder (job/shard.py's dirname)
# What write_atomic's mkstemp names look like: TMP_PREFIX, the final name, "." and a random tail.
# Any other ".tmp-..." entry is not ours, so it is neither deleted nor taken as a sign of ownership.
TMP_RE = re.compile(
    rf"{re.escape(TMP_PREFIX)}(part-\d+\.parquet|job\.json|stats\.json|\.?_?steps\.(parquet|pq)"
    r"|SUCCESS|verdict\.json|results\.jsonl|report\.html|_job\.json|_stats\.json|_SUCCESS)\.\w+"
)


def part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


def steps_part_name(n: int) -> str:
    return f"steps-{n:05d}.pq"


def is_ours(name: str) -> bool:
    """A top-level name today's batchgen writes. An older layout's names (OLD_NAMES) are not:
    a results.jsonl, report.html or _SUCCESS (Spark's and Hadoop's marker) at the top is
    someone else's file unless 0.1's _job.json says otherwise (is_old_layout)."""
    return (
        name == META_DIR
        or TMP_RE.fullmatch(name) is not None
        or PART_RE.fullmatch(name) is not None
    )


def is_old_layout(names: list[str]) -> bool:
    """The top-level names of a batchgen 0.1 output: its run's _job.json (written first), or
    its merge's _stats.json beside shard folders."""
    shards = any(SHARD_DIR_RE.fullmatch(n) for n in names)
    return "_job.json" in names or ("_stats.json" in names and shards)


def check_meta_dir(directory: str | os.PathLike[str]) -> None:
    """Refuse a META_DIR that is not batchgen's own folder: a file, or a symbolic link (a
    takeover or --overwrite would delete the files of the folder it points to), and links
    for the folders in it that runs write (the step timeline, Slurm's logs)."""
    for rel in (META_DIR, STEPS_DIR, SLURM_DIR):
        path = os.path.join(os.fspath(directory), rel)
        if os.path.islink(path):
            raise InputError(
                f"{path} is a symbolic link (to {os.readlink(path)}); batchgen never follows a "
                "link in its own folder of an output: remove the link, or pick another output"
            )
        if os.path.exists(path) and not os.path.isdir(path):
            raise InputError(
                f"{path} is a file, where batchgen keeps its folder {rel}/: move it away, or "
                "pick another output directory"
            )


def holds_unsharded_run(directory: str | os.PathLike[str]) -> bool:
    """The directory holds a run's own results (a job file or parts at its top), not only the
    shard folders of a sharded one (whose merge writes neither)."""
    names = os.listdir(directory)
    job = os.path.exists(os.path.join(directory, JOB_FILE)) or "_job.json" in names
    return job or any(PART_RE.fullmatch(n) for n in names)


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
    check_meta_dir(directory)
    _rename_hidden_parquet(directory)
    names = os.listdir(directory)
    if not is_old_layout(names):  # a results.jsonl or _SUCCESS of someone else's stays put
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


def _rename_hidden_parquet(directory: str) -> None:
    """An earlier batchgen's hidden files that end in ".parquet" (a merged copy, the step
    timeline's parts or a merge's single file) under today's names, out of DuckDB's globs (see
    MERGED_FILE). Only where META_DIR is already there: the output is batchgen's."""
    if not os.path.isdir(os.path.join(directory, META_DIR)):
        return
    moves = [(os.path.join(directory, META_DIR, "merged.parquet"), MERGED_FILE)]
    moves.append((os.path.join(directory, ".steps.parquet"), STEPS_FILE))
    steps = os.path.join(directory, STEPS_DIR)
    if os.path.isdir(steps) and not os.path.islink(steps):
        for n in os.listdir(steps):
            if m := OLD_STEPS_PART_RE.fullmatch(n):
                moves.append((os.path.join(steps, n), f"{STEPS_DIR}/{steps_part_name(int(m[1]))}"))
    for old, new in moves:
        if os.path.isfile(old) and not os.path.islink(old):
            log.warning("output %s: moving %s to %s", directory, old, new)
            try:
                os.replace(old, os.path.join(directory, new))
            except OSError as e:
                raise InputError(os_error(e, f"cannot move {old} to {new}")) from None
