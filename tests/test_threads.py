"""CPU threads (issue 38, item 8): torch runs on the CPUs this process may use (its affinity
mask capped by a cgroup quota), and OpenMP's threads wait passively, so a busy core does not
stall every parallel region."""

import os
import subprocess
import sys

import pytest

from batchgen.job.threads import cpu_threads

CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("v2", "v1", "want"),
    [
        ("50000 100000\n", None, 1),  # half a CPU: one thread
        ("150000 100000\n", None, min(CPUS, 2)),  # one and a half: two, if the mask allows
        ("max 100000\n", None, CPUS),  # no quota: the mask
        (None, ("50000", "100000"), 1),  # cgroup v1's quota
        (None, ("-1", "100000"), CPUS),  # v1 without one
        (None, None, CPUS),  # no cgroup files at all
    ],
)
def test_threads_are_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path, v2, v1, want):
    cpu_max, v1_dir = tmp_path / "cpu.max", tmp_path / "cpu"
    if v2 is not None:
        cpu_max.write_text(v2)
    if v1 is not None:
        v1_dir.mkdir()
        (v1_dir / "cpu.cfs_quota_us").write_text(v1[0])
        (v1_dir / "cpu.cfs_period_us").write_text(v1[1])
    assert cpu_threads(cpu_max, v1_dir) == want


def test_one_cpu_of_affinity_is_one_thread_and_waits_are_passive():
    """taskset's mask (Slurm binds CPUs so too) gives one thread; importing batchgen makes
    OpenMP's waits passive before torch loads it, and a user's OMP_WAIT_POLICY is kept."""
    code = (
        "import os, sys, batchgen, torch\n"
        "from batchgen.job.threads import cpu_threads\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "print(cpu_threads(), os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["1", "PASSIVE"], r.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["1", "ACTIVE"], r.stderr


def test_a_job_without_threads_runs_on_cpu_threads(model, tmp_path, monkeypatch):
    """`batchgen run` without --threads sets torch's count to cpu_threads(); --threads wins."""
    from helpers import prompt_file, run_job

    seen = []
    monkeypatch.setattr("batchgen.runner.run.cpu_threads", lambda: 3)
    monkeypatch.setattr("torch.set_num_threads", seen.append)
    run_job(prompt_file(tmp_path, 2), tmp_path / "a", model, "--max-new-tokens", 2)
    run_job(prompt_file(tmp_path, 2), tmp_path / "b", model, "--max-new-tokens", 2, "--threads", 1)
    assert seen[0] == 3 and seen[-1] == 1, seen
