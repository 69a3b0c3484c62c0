"""`batchgen slurm`: an sbatch job array that runs one shard of a job per array task.

Task I of an N-task array runs `batchgen run SOURCE --shard I/N --quiet` with the Python that
wrote the script, into OUT/shard-IIIII-of-NNNNN/, and logs to OUT/.batchgen/slurm/<job>_<task>.out,
beside a copy of the script: hidden, so that OUT still reads as the result rows only.
`batchgen merge OUT --max-error-rate R` then checks and combines the shards and judges the job's
error rate once, over every shard's rows (R: the job's --max-error-rate, printed at submit and
written into the script); the tasks run with --max-error-rate 1, as --workers' do, so that no task
fails on its own shard's share.

Stopping and resuming. batchgen flushes its finished rows and exits 143 on SIGTERM, and a rerun
of the same command resumes, so the script only has to get SIGTERM to it and get the task run
again:
  - preemption (PreemptMode=REQUEUE) and scancel signal every process of the task, batchgen
    included; `--requeue` lets Slurm put a preempted task back in the queue, and a scancel is
    left cancelled;
  - the time limit: `--signal=B:USR1@<grace>` sends USR1 to the batch shell <grace> seconds
    before the limit. USR1 rather than TERM tells the time limit apart from a scancel: on USR1
    the script passes SIGTERM to batchgen, waits for its flush, and requeues the task itself
    (scontrol requeue), which then resumes where it stopped.
Logs are opened with --open-mode=append, so a requeued task adds to its log. A task whose shard
is already complete (OUT/shard-.../.batchgen/SUCCESS) exits at once, so resubmitting the whole
array (or `--only 2,5`) redoes only what is missing.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from batchgen.data.atomic import os_error, write_atomic
from batchgen.data.layout import SLURM_DIR, SUCCESS_FILE, check_meta_dir
from batchgen.engine.compile_cache import OFF
from batchgen.errors import RuntimeFailure
from batchgen.job.config import RunConfig
from batchgen.job.model_spec import resolve_compile_cache
from batchgen.job.shard import without_array_task


class SlurmError(RuntimeError):
    """The job cannot be submitted as asked (exit 2)."""


class SbatchFailed(RuntimeFailure):
    """sbatch ran and refused or failed (exit 1)."""


def parse_only(text: str | None) -> tuple[int, ...]:
    """--only's shard numbers ("2,5")."""
    if not text:
        return ()
    try:
        return tuple(int(i) for i in text.split(","))
    except ValueError:
        raise SlurmError(
            f"--only {text!r}: give comma-separated shard numbers, e.g. --only 2,5"
        ) from None


@dataclass(slots=True)
class SbatchOptions:
    shards: int
    partition: str | None = None
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None  # e.g. 32G
    time: str | None = None  # e.g. 04:00:00
    only: tuple[int, ...] = ()  # submit only these shards (default all)
    max_parallel: int | None = None  # at most this many tasks at once (--array=...%K)
    grace_s: int = 120  # USR1 this long before the time limit: time to flush
    job_name: str = "batchgen"
    extra: tuple[str, ...] = ()  # more sbatch options, e.g. --account=abc

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise SlurmError(f"--shards must be >= 1, got {self.shards}")
        bad = [i for i in self.only if not 0 <= i < self.shards]
        if bad:
            raise SlurmError(f"--only {bad}: shards are numbered 0..{self.shards - 1}")
        if self.max_parallel is not None and self.max_parallel < 1:
            raise SlurmError(
                f"--max-parallel must be >= 1, got {self.max_parallel} (leave it out for no cap)"
            )
        if self.grace_s < 0:
            raise SlurmError(
                f"--grace must be >= 0 seconds before the time limit, got {self.grace_s}"
            )

    @property
    def array(self) -> str:
        tasks = ",".join(map(str, sorted(set(self.only)))) if self.only else f"0-{self.shards - 1}"
        return tasks + (f"%{self.max_parallel}" if self.max_parallel else "")


def _compile_cache_root(cfg: RunConfig) -> str:
    """One compile cache for every task of the array, as resolved where it is submitted (a
    home or project directory on the cluster's shared filesystem): the first task to finish
    its warm-up writes the compiled artifacts, tasks that start later load them
    (engine/compile_cache.py). "off" (the option's or $BATCHGEN_COMPILE_CACHE's) stays off."""
    root = resolve_compile_cache(cfg.compile_cache)
    return OFF if root is None else str(root.resolve())


def merge_command(cfg: RunConfig) -> str:
    """What merges the array's shards once every task is done, with the job's error-rate
    verdict over all of them."""
    rate = f"{cfg.max_error_rate:g}"
    return shlex.join(["batchgen", "merge", str(cfg.output), "--max-error-rate", rate])


def sbatch_script(source: str, cfg: RunConfig, run_args: list[str], opts: SbatchOptions) -> str:
    """The script that runs `batchgen run SOURCE *run_args` (which make `cfg`) as an array."""
    if cfg.overwrite:
        raise SlurmError(
            "overwrite would make every requeued task start its shard again from scratch; "
            f"delete {cfg.output} (or its shard directories) before submitting instead"
        )
    out = Path(cfg.output).resolve()
    if "%" in str(out):
        raise SlurmError(
            f"output {out}: sbatch reads % in a log path as a pattern (%A, %a, ...); "
            "pick an output path without %"
        )
    lines = [
        "#!/bin/bash",
        _directive("job-name", opts.job_name),
        _directive("array", opts.array),
        "#SBATCH --ntasks=1",
        _directive("output", f"{out}/{SLURM_DIR}/%A_%a.out"),
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        _directive("signal", f"B:USR1@{opts.grace_s}"),
        _directive("chdir", Path.cwd()),  # relative paths in the job mean what they mean here
    ]
    for flag, value in (
        ("partition", opts.partition),
        ("gpus-per-task", _gpus_per_task(cfg, opts)),
        ("cpus-per-task", opts.cpus_per_task),
        ("mem", opts.mem),
        ("time", opts.time),
    ):
        if value is not None:
            lines.append(_directive(flag, value))
    for e in opts.extra:
        _refuse_control_characters("--sbatch-arg", e)
        lines.append(f"#SBATCH {e}")
    # The shard count is written in, not read from SLURM_ARRAY_TASK_COUNT, so that an array
    # of only some tasks (--only) still runs shards of the same split.
    run = [sys.executable, "-m", "batchgen.cli", "run", source, *run_args]
    lines.append(f"""
# Written by `batchgen slurm`; see batchgen/scaleout/slurm.py for how stopping and resuming work.
# When every task is done: {merge_command(cfg)}
# (each task leaves the error rate to it: --max-error-rate 1 here)
set -u
export PYTHONUNBUFFERED=1
export BATCHGEN_COMPILE_CACHE={shlex.quote(_compile_cache_root(cfg))}
N={opts.shards}
I=$SLURM_ARRAY_TASK_ID
SHARD_DIR={shlex.quote(str(out))}/$(printf 'shard-%05d-of-%05d' "$I" "$N")
DONE="$SHARD_DIR"/{shlex.quote(SUCCESS_FILE)}
echo "[$(date -Is)] task $SLURM_ARRAY_JOB_ID.$I (job $SLURM_JOB_ID," \
    "restart ${{SLURM_RESTART_COUNT:-0}}) on $(hostname): shard $I/$N"
if [ -e "$DONE" ]; then
    echo "shard $I/$N is already complete"
    exit 0
fi

requeue=0
pid=
stop() {{
    [ "$1" = USR1 ] && requeue=1
    echo "[$(date -Is)] SIG$1: stopping batchgen (it saves finished rows)"
    [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null
}}
trap 'stop USR1' USR1
trap 'stop TERM' TERM

{shlex.join(run)} --max-error-rate 1 --shard "$I/$N" --quiet &
pid=$!
# A trapped signal ends `wait` early; wait again until batchgen has flushed and exited.
wait "$pid"
rc=$?
while kill -0 "$pid" 2>/dev/null; do
    wait "$pid"
    rc=$?
done
echo "[$(date -Is)] batchgen exited with $rc"
if [ "$requeue" = 1 ] && [ ! -e "$DONE" ]; then
    echo "time limit near: requeueing ${{SLURM_ARRAY_JOB_ID}}_$I to resume"
    scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_$I"
fi
exit "$rc"
""")
    return "\n".join(lines)


def _gpus_per_task(cfg: RunConfig, opts: SbatchOptions) -> int | None:
    """--gpus-per-task as given, or, for a tensor-parallel job on GPUs, one per rank."""
    tp = cfg.tensor_parallel_size
    if tp == 1 or cfg.device == "cpu":
        return opts.gpus_per_task
    if opts.gpus_per_task is None:
        return tp
    if opts.gpus_per_task < tp:
        raise SlurmError(
            f"--gpus-per-task {opts.gpus_per_task} is fewer than --tensor-parallel-size {tp}: "
            f"each task runs {tp} ranks, one GPU each; ask for {tp} GPUs per task"
        )
    return opts.gpus_per_task


def _directive(flag: str, value: object) -> str:
    """`#SBATCH --flag=value`. sbatch parses these lines itself, not the shell: it splits at
    whitespace and groups with quotes, and a newline would end the line (and let the rest of
    the value run as a line of the script). So a value with whitespace is double-quoted, and
    one with a control character, a quote or a backslash is refused."""
    text = str(value)
    _refuse_control_characters(f"--{flag}", text)
    if any(c in text for c in "\"'\\"):
        raise SlurmError(
            f"--{flag} {text!r}: quotes and backslashes cannot go into an #SBATCH line"
        )
    if any(c.isspace() for c in text):
        text = f'"{text}"'
    return f"#SBATCH --{flag}={text}"


def _refuse_control_characters(flag: str, text: str) -> None:
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise SlurmError(
            f"{flag} {text!r} holds a newline or another control character, which cannot go "
            "into an #SBATCH line; pick a value without one"
        )


def submit(output: str, script: str) -> tuple[str, Path]:
    """sbatch the script (on its stdin); returns the job id and where a copy of the script is
    kept, beside the tasks' logs. The log folder must exist before a task starts (Slurm does
    not make it); a failed submit removes the folders it made, so it leaves nothing behind."""
    if not shutil.which("sbatch"):
        raise SlurmError("sbatch is not on PATH; run on a Slurm login node, or use --dry-run")
    if Path(output).is_dir():
        check_meta_dir(output)  # the logs go there: never through a link
    logs = Path(output) / SLURM_DIR
    made = [p for p in (logs, *logs.parents) if not p.exists()]
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SbatchFailed(os_error(e, f"cannot create {logs}")) from None
    r = subprocess.run(
        ["sbatch", "--parsable"],
        input=script,
        capture_output=True,
        text=True,
        env=without_array_task(),  # an enclosing array task's shard must not leak into the new job
    )
    if r.returncode:
        for p in made:  # innermost first
            p.rmdir()
        raise SbatchFailed(f"sbatch failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    # Written whole under a new name and renamed: a link planted there is replaced, not followed.
    write_atomic(logs, "batchgen.sbatch", lambda f: f.write(script.encode()))
    return r.stdout.strip().split(";")[0], logs / "batchgen.sbatch"  # "jobid" or "jobid;cluster"
