"""`batchgen run --tensor-parallel-size 2` as a user runs it: the real CLI, real rank processes
over gloo, real signals. A killed or stopped rank ends the job with one clear line and no process
left behind, and the same command again completes every row exactly once."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import (
    FAST,
    ROOT,
    assert_one_line_error,
    cli_command,
    prompts,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    start_cli,
    success,
    wait_for_part,
    write_parquet,
)
from test_slurm import make_job

from batchgen.cli import main

N = 24
# A part per 4 rows, flushed at once: a job of several parts, running for seconds.
FLAGS = ("--max-new-tokens", 16, "--ignore-eos", "--max-num-seqs", 4, "--rows-per-part", 4)
FLAGS = (*FLAGS, "--flush-seconds", 0)


@pytest.fixture(scope="module")
def job(model, tmp_path_factory):
    """The input and the texts of an uninterrupted one-process run, by row number."""
    d = tmp_path_factory.mktemp("tp")
    src = write_parquet(d / "in.parquet", {"prompt": prompts(N)})
    run_job(src, d / "one", model, *FLAGS)
    return (
        src,
        {i: r["generated_text"] for i, r in rows_by_id(d / "one").items()},
        read_stats(d / "one"),
    )


def _followers(pid: int) -> list[int]:
    """The follower ranks that process `pid` started."""
    found = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", "batchgen.parallel.follower"],
        capture_output=True,
        text=True,
    )
    return [int(p) for p in found.stdout.split()]


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.05)
    return False


def _mid_job(model, job, tmp_path):
    """A two-rank `batchgen run` process with a part written: (out, its args, the process,
    rank 1's pid)."""
    out = tmp_path / "out"
    args = ("run", job[0], "-o", out, "--model", model, *FAST, *FLAGS, "-tp", 2)
    proc = start_cli(*args)
    wait_for_part(out, proc)
    (follower,) = _followers(proc.pid)
    return out, args, proc, follower


def _complete(out, clean):
    """Every row once, as the one-process run wrote it (>= 90%: an all-reduce may move a
    near-tie, tests/test_tensor_parallel_ranks.py checks those)."""
    rows = rows_by_id(out)  # fails on a duplicate id
    assert sorted(rows) == sorted(clean) and success(out)
    same = sum(rows[i]["generated_text"] == clean[i] for i in clean)
    assert same >= 0.9 * N, f"{same}/{N} rows equal the one-process run"


def test_two_ranks_from_the_command_line(model, job, tmp_path):
    src, clean, one = job
    out = tmp_path / "out"
    run_job(src, out, model, *FLAGS, "--tensor-parallel-size", 2)
    _complete(out, clean)
    stats = read_stats(out)
    assert stats["tensor_parallel_size"] == 2 and one["tensor_parallel_size"] == 1
    assert 0 < stats["weights_bytes_per_rank"] < 0.6 * one["weights_bytes_per_rank"]
    assert 0 < stats["collective_share"] < 1  # eager CPU steps time their all-reduces
    assert "collective_share" not in one


def test_a_killed_rank_ends_the_job_and_the_rerun_completes(model, job, tmp_path):
    clean = job[1]
    out, args, proc, follower = _mid_job(model, job, tmp_path)
    os.kill(follower, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)  # bounded: a hang fails here
    assert proc.returncode == 1
    assert_one_line_error(stderr, "tensor-parallel rank 1 was killed by SIGKILL", "run the same")
    assert 0 < len(rows_by_id(out)) < N and not success(out)

    rerun = subprocess.run(
        cli_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr
    _complete(out, clean)


def test_a_killed_rank_0_takes_its_ranks_with_it(model, job, tmp_path):
    clean = job[1]
    out, args, proc, follower = _mid_job(model, job, tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert _gone(follower, within=10), "rank 1 outlived rank 0"
    # A tensor-parallel job resumes on one process too (the split is not part of the job).
    run_cli(*args[:-2])
    _complete(out, clean)


@pytest.mark.parametrize("target", ["rank 0", pytest.param("rank 1", marks=pytest.mark.slow)])
def test_sigterm_to_any_rank_stops_the_job_cleanly(model, job, tmp_path, target):
    clean = job[1]
    out, args, proc, follower = _mid_job(model, job, tmp_path)
    os.kill(proc.pid if target == "rank 0" else follower, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 143, stderr
    assert "run the same command again to resume" in stderr and "Traceback" not in stderr
    assert _gone(follower, within=10)
    saved = rows_by_id(out)
    assert 0 < len(saved) < N
    assert sum(r["generated_text"] == clean[i] for i, r in saved.items()) >= 0.9 * len(saved)

    run_cli(*args)
    _complete(out, clean)
    assert read_stats(out)["rows_skipped_done"] == len(saved)


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (3, ("attention heads 4", "sizes that work: 1, 2, 4")),
        (0, ("--tensor-parallel-size", "x>=1")),
    ],
)
def test_sizes_that_cannot_split_exit_2_before_loading(model, job, tmp_path, n, words):
    src, _, _ = job
    r = run_job(src, tmp_path / "out", model, "-tp", n, exit_code=2)
    assert_one_line_error(r, *words)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_dry_run_prints_ranks_and_their_devices(model, job, tmp_path, monkeypatch):
    src, _, _ = job
    r = run_job(src, tmp_path / "out", model, "-tp", 2, "--dry-run")
    assert "rank 0 on cpu, rank 1 on cpu" in r.stdout
    # Workers x ranks on an 8-GPU node: disjoint GPUs, each worker's ranks in order.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    base = ("run", src, "-o", tmp_path / "out", "--model", model, "--device", "cuda")
    r = run_cli(*base, "--workers", "auto", "-tp", 4, "--dry-run")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "GPUs 0,1,2,3; rank 0 on GPU 0, rank 1 on GPU 1, rank 2 on GPU 2" in lines[0]
    assert "GPUs 4,5,6,7; rank 0 on GPU 4" in lines[1] and "rank 3 on GPU 7" in lines[1]
    r = run_cli(*base, "--workers", 3, "-tp", 4, "--dry-run", exit_code=2)
    assert_one_line_error(r, "--workers 3 needs 3 x 4 GPUs", "only 8")
    assert not (tmp_path / "out").exists()


def test_slurm_asks_for_a_gpu_per_rank(tmp_path):
    spec = make_job(tmp_path, tmp_path / "model", device="cuda")
    r = CliRunner().invoke(
        main, ["slurm", "--dry-run", str(spec), "--shards", "2", "--", "-tp", "4"]
    )
    assert r.exit_code == 0, r.output
    assert "#SBATCH --gpus-per-task=4" in r.output.splitlines()
    args = [
        "slurm",
        "--dry-run",
        str(spec),
        "--shards",
        "2",
        "--gpus-per-task",
        "2",
        "--",
        "-tp",
        "4",
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "ask for 4 GPUs per task" in r.output
