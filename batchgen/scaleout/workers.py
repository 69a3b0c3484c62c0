"""`batchgen run --workers N|auto`: one worker process per GPU over shards of the input.

Worker i of N is `batchgen run <the same job> --shard i/N` in its own process, pinned to one GPU
with CUDA_VISIBLE_DEVICES (so each compiles and caches for a single device, and no process
touches another's memory). The workers write OUT/shard-*-of-N/ exactly as N Slurm array tasks
would, and the parent merges them (batchgen.scaleout.merge) once all have finished, so the rows are
those of one process: the same prompts, each run once, greedy outputs equal.

On the CPU (`--device cpu`) N workers share the cores, each with cores/N threads: mostly a way
to test this on a machine without GPUs. SIGTERM/SIGINT are passed to the workers, which save
their finished rows; running the same command again resumes every unfinished shard.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from batchgen.choices import Choice
from batchgen.data.layout import JOB_FILE
from batchgen.errors import ConfigError, JobInterrupted, WorkersFailed
from batchgen.job.config import RunConfig
from batchgen.job.shard import Shard, without_array_task
from batchgen.scaleout.merge import merge
from batchgen.scaleout.shard_report import MergeSummary


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_workers(cfg: RunConfig) -> list[dict[str, str]]:
    """The extra environment of each worker: its length is the number of workers. A worker
    gets its own GPUs, disjoint from the others': one, or with --tensor-parallel-size N, N
    (its ranks run on them in order)."""
    device, tp = cfg.device, cfg.tensor_parallel_size
    if device.startswith("cuda:"):
        raise ConfigError(
            f"--workers runs one process per GPU; instead of --device {device}, choose the GPUs "
            "with CUDA_VISIBLE_DEVICES"
        )
    gpus = [] if device == "cpu" else visible_gpus()
    if device == "cuda" and not gpus:
        raise ConfigError("--device cuda with --workers, but no GPU is visible")
    if gpus:
        n = len(gpus) // tp if cfg.workers == "auto" else cfg.workers
        if n < 1 or n * tp > len(gpus):
            each = f" x {tp} GPUs (--tensor-parallel-size)" if tp > 1 else ""
            raise ConfigError(
                f"--workers {cfg.workers} needs {max(n, 1)}{each}, but only {len(gpus)} GPU(s) "
                "are visible"
            )
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} for i in range(n)]
    # CPU: "auto" is one process using every core; N processes split the cores.
    n = 1 if cfg.workers == "auto" else cfg.workers
    threads = str(max(1, (os.cpu_count() or 1) // n))
    return [{"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads}] * n


def describe_workers(cfg: RunConfig) -> str:
    """What `batchgen run` would start (--dry-run): each worker's shard, GPUs and ranks."""
    tp = cfg.tensor_parallel_size
    if cfg.workers == 1:  # one process over the whole input
        cuda = cfg.device.startswith("cuda")
        if cfg.device == "auto":
            import torch

            cuda = torch.cuda.is_available()
        devices = [f"cuda:{r}" for r in range(tp)] if cuda else ["cpu"] * tp
        return f"one process -> {cfg.output_dir}; {_ranks(devices)}"
    envs = plan_workers(cfg)
    lines = []
    for i, env in enumerate(envs):
        gpus = env["CUDA_VISIBLE_DEVICES"]
        where = f"GPUs {gpus}" if gpus else f"CPU, {env['OMP_NUM_THREADS']} threads"
        if tp > 1:
            devices = [f"GPU {g}" for g in gpus.split(",")] if gpus else ["cpu"] * tp
            where += f"; {_ranks(devices)}"
        shard = Shard(i, len(envs))
        lines.append(f"worker {i}: shard {shard} -> {cfg.output}/{shard.dirname}, {where}")
    return "\n".join(lines)


def _ranks(devices: list[str]) -> str:
    return ", ".join(f"rank {r} on {d}" for r, d in enumerate(devices))


def _job_spec(cfg: RunConfig) -> dict:
    """cfg as a job spec for the workers, without the parts each worker sets itself."""
    spec = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    spec = {k: v.value if isinstance(v, Choice) else v for k, v in spec.items()}  # yaml: strings
    # The error rate is the job's, judged once over every shard after the merge (a shard's own
    # rate over or under the limit says nothing about the job's).
    spec.update(quiet=True, max_error_rate=1.0)
    for k in ("workers", "shard"):
        del spec[k]
    return spec


def _has_job_file(directory: Path) -> bool:
    """A run's fingerprint is there, in today's layout or batchgen 0.1's."""
    return (directory / JOB_FILE).exists() or (directory / "_job.json").exists()


def _remove_other_splits(out: Path, n: int) -> None:
    """With --overwrite, shard directories of an earlier split into another count go."""
    for p in out.glob("shard-*-of-*"):
        shard = Shard.from_dirname(p.name)
        if shard is not None and shard.count != n and _has_job_file(p):
            shutil.rmtree(p)


def _check_split(out: Path, n: int) -> None:
    """The worker count decides which rows go into which shard directory: refuse to add an
    N-way split to an output that holds another split (or an unsharded run), which merge would
    refuse only after all the work."""
    if _has_job_file(out):
        raise ConfigError(
            f"output {out} holds the results of a run without --workers; rerun it that way to "
            "resume, or pick another output directory"
        )
    counts = sorted(
        {s.count for p in out.glob("shard-*-of-*") if (s := Shard.from_dirname(p.name))}
    )
    other = [c for c in counts if c != n]
    if other:
        raise ConfigError(
            f"output {out} holds shards of a {other[0]}-way split, and --workers {n} would split "
            f"the rows {n} ways; rerun with --workers {other[0]} to resume, or pass --overwrite"
        )


def run_workers(cfg: RunConfig) -> MergeSummary:
    """Run cfg over N worker processes, then merge their shards; see the module docstring."""
    envs = plan_workers(cfg)
    n = len(envs)
    # Check the model, input and template once here rather than fail N times in the workers;
    # on the CPU, so that the parent never takes memory on a GPU (and without the
    # quantization, which the workers check on their own devices).
    from batchgen.job.open import open_job

    cpu = dict(device="cpu", dtype="float32", quantize="none", quant_group_size=None)
    open_job(dataclasses.replace(cfg, **cpu, workers=1))
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite:
        _remove_other_splits(out, n)
    _check_split(out, n)
    received: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    with tempfile.TemporaryDirectory(prefix="batchgen-workers-") as tmp:
        spec = Path(tmp) / "job.yaml"
        spec.write_text(yaml.safe_dump(_job_spec(cfg), sort_keys=False))
        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i, extra in enumerate(envs):
                # Not an enclosing Slurm array task's shard: each worker is told its own.
                env = without_array_task()
                cmd = [sys.executable, "-m", "batchgen.cli", "run", str(spec)]
                procs.append(subprocess.Popen([*cmd, "--shard", f"{i}/{n}"], env={**env, **extra}))
                if received:  # a signal arrived while starting: do not start more
                    break
            codes = [p.wait() for p in procs]
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if received:
        raise JobInterrupted(received[0])
    failed = [f"{i}/{n} (exit {c})" for i, c in enumerate(codes) if c != 0]
    if failed:
        raise WorkersFailed(
            f"worker(s) {', '.join(failed)} failed (their messages are above); the other shards "
            "are kept, and running the same command again redoes only what is missing"
        )
    return merge(out, max_error_rate=cfg.max_error_rate)  # the job's verdict, once
