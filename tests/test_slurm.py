"""`batchgen slurm`: the sbatch script, its signal handling, and a real one-node Slurm.

The tests marked `slurm` start munge + slurmctld + slurmd on localhost (tests/slurm_cluster.py,
which installs the Debian packages when missing). Where that cannot work (not root, no apt) they
skip, except under CI=true, where not running them is an error.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from helpers import assert_one_line_error, listing, run_job, success
from slurm_cluster import LocalSlurm, SlurmUnavailable, logs_tail

from batchgen.cli import main
from batchgen.data.layout import MERGED_FILE, SLURM_DIR, VERDICT_FILE

BATCHGEN = [sys.executable, "-m", "batchgen.cli"]
# Long enough (200 rows, 2 sequences at a time, a part per 2 rows) that a time-limit signal
# lands mid-job.
LONG_JOB = dict(
    n_rows=200, max_new_tokens=32, ignore_eos=True, max_num_seqs=2, rows_per_part=2, flush_seconds=0
)


def make_job(tmp_path: Path, model: Path, n_rows: int = 30, **extra) -> Path:
    """A job spec over a small Parquet dataset with string ids, on the tiny model."""
    data = tmp_path / "reviews.parquet"
    pq.write_table(
        pa.table(
            {
                "key": [f"r{i:03d}" for i in range(n_rows)],
                "text": [f"great product {i}, would buy again" for i in range(n_rows)],
            }
        ),
        data,
    )
    spec = {
        "input": str(data),
        "output": str(tmp_path / "out"),
        "model": str(model),
        "id_column": "key",
        "template": "Review: {{ text }}\nSentiment:",
        "max_new_tokens": 3,
        "device": "cpu",
        "compile": False,
        **extra,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def dry_run(*args: str) -> str:
    r = CliRunner().invoke(main, ["slurm", "--dry-run", *args])
    assert r.exit_code == 0, r.output
    return r.output


def test_dry_run_script(tmp_path):
    spec = make_job(tmp_path, tmp_path / "model")
    script = dry_run(
        str(spec),
        "--shards",
        "3",
        "-p",
        "gpu",
        "--gpus-per-task",
        "1",
        "--time",
        "01:00:00",
        "--cpus-per-task",
        "4",
        "--mem",
        "16G",
        "--",
        "--limit",
        "10",
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in (
        "--array=0-2",
        "--requeue",
        "--signal=B:USR1@120",
        "--open-mode=append",
        f"--output={tmp_path}/out/{SLURM_DIR}/%A_%a.out",
        "--partition=gpu",
        "--gpus-per-task=1",
        "--time=01:00:00",
        "--cpus-per-task=4",
        "--mem=16G",
        f"--chdir={Path.cwd()}",
    ):
        assert f"#SBATCH {want}" in lines
    run_line = next(x for x in lines if "-m batchgen.cli run" in x)
    assert run_line.startswith(f"{sys.executable} -m batchgen.cli run {spec} --limit 10")
    assert run_line.endswith('--shard "$I/$N" --quiet &')
    assert "N=3" in lines and "scontrol requeue" in script
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    some = dry_run(str(spec), "--shards", "5", "--only", "1,3", "--max-parallel", "1")
    assert "#SBATCH --array=1,3%1" in some and "N=5" in some


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shards", "2", "--", "--shard", "0/2"], "leave out --shard"),
        (["--shards", "2", "--only", "2"], "numbered 0..1"),
        (["--shards", "0"], "Invalid value for '--shards'"),
        (["--shards", "2", "--", "--no-such-flag"], "no-such-flag"),
        (["--shards", "2", "--", "--overwrite"], "start its shard again from scratch"),
    ],
)
def test_slurm_refuses_bad_arguments(tmp_path, args, message):
    spec = make_job(tmp_path, tmp_path / "model")
    r = CliRunner().invoke(main, ["slurm", "--dry-run", str(spec), *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_slurm_refuses_unknown_spec_keys(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("input: x.parquet\noutput: out\nmax_tokens: 5\n")
    r = CliRunner().invoke(main, ["slurm", str(spec), "--shards", "2", "--dry-run"])
    assert r.exit_code == 2
    assert "unknown key(s) max_tokens" in r.output and "max_new_tokens" in r.output


def test_a_failed_submit_writes_nothing(tmp_path, fake_sbatch):
    spec = make_job(tmp_path, tmp_path / "model")
    fake_sbatch("echo 'sbatch: error: invalid partition' >&2; exit 1")
    r = CliRunner().invoke(main, ["slurm", str(spec), "--shards", "2"])
    assert r.exit_code == 1 and "invalid partition" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_the_script_and_logs_are_hidden_in_the_output(tmp_path, fake_sbatch):
    spec = make_job(tmp_path, tmp_path / "model")
    fake_sbatch("echo 4242")
    r = CliRunner().invoke(main, ["slurm", str(spec), "--shards", "2"])
    assert r.exit_code == 0 and r.stdout.strip() == "4242", r.output
    out = tmp_path / "out"
    assert listing(out) == [f"{SLURM_DIR}/batchgen.sbatch"]
    assert "#SBATCH --array=0-1" in (out / SLURM_DIR / "batchgen.sbatch").read_text()


def test_the_merge_command_carries_the_jobs_error_rate(tmp_path, fake_sbatch):
    # the tasks leave the rate to the merge (--max-error-rate 1 each); the merge it prints
    # judges the job's rows against the job's --max-error-rate
    spec = make_job(tmp_path, tmp_path / "model", max_error_rate=0.3)
    out = tmp_path / "out"
    script = dry_run(str(spec), "--shards", "2")
    run_line = next(x for x in script.splitlines() if "-m batchgen.cli run" in x)
    assert run_line.endswith('--max-error-rate 1 --shard "$I/$N" --quiet &')
    assert f"# When every task is done: batchgen merge {out} --max-error-rate 0.3" in script
    override = dry_run(str(spec), "--shards", "2", "--", "--max-error-rate", "0.05")
    assert f"batchgen merge {out} --max-error-rate 0.05" in override
    fake_sbatch("echo 4242")
    r = CliRunner().invoke(main, ["slurm", str(spec), "--shards", "2"])
    assert r.exit_code == 0, r.output
    assert f"when all are done: batchgen merge {out} --max-error-rate 0.3" in r.stderr


def test_slurm_refuses_an_unsharded_jobs_output(tmp_path, model):
    # the README's block: `batchgen run jobs/label_sentiment.yaml`, then its Slurm array
    spec = make_job(tmp_path, model, n_rows=4)
    run_job(spec, tmp_path / "out", model)
    r = CliRunner().invoke(main, ["slurm", "--dry-run", str(spec), "--shards", "2"])
    assert r.exit_code == 2 and "without --shard" in r.output, r.output


def test_script_saves_requeues_and_resumes_on_usr1(tmp_path, gpt2):
    """The time-limit path, without Slurm: USR1 to the batch shell stops batchgen (which saves
    its rows) and requeues the task; the rerun resumes and completes."""
    spec = make_job(tmp_path, gpt2, **LONG_JOB)  # 100 rows a shard
    script = tmp_path / "job.sbatch"
    script.write_text(dry_run(str(spec), "--shards", "2"))
    bin_dir = tmp_path / "bin"  # a fake scontrol that records how it was called
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_ARRAY_JOB_ID": "77",
        "SLURM_JOB_ID": "78",
    }
    shard_dir = tmp_path / "out" / "shard-00001-of-00002"

    proc = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while not list(shard_dir.glob("part-*.parquet")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, log
    assert "SIGUSR1: stopping batchgen" in log and "requeueing 77_1" in log, log
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77_1"]
    assert not success(shard_dir)
    saved = {
        x for p in shard_dir.glob("part-*.parquet") for x in pq.read_table(p)["key"].to_pylist()
    }
    assert saved

    rerun = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    ids = [x for p in shard_dir.glob("part-*.parquet") for x in pq.read_table(p)["key"].to_pylist()]
    assert len(ids) == len(set(ids)) and saved < set(ids)
    again = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "already complete" in again.stdout


# ---- a real one-node Slurm --------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    cluster = LocalSlurm()
    try:
        cluster.start()
    except SlurmUnavailable as e:
        reason = f"no local Slurm cluster: {e}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI must run the Slurm tests)\n{logs_tail()}")
        pytest.skip(reason)
    yield cluster
    cluster.stop()


def submit(spec: Path, *args: str) -> str:
    r = subprocess.run(
        [*BATCHGEN, "slurm", str(spec), *args],
        capture_output=True,
        text=True,
        cwd=spec.parent,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()[0]


def wait_for(job: str, timeout: float = 300, until=None) -> None:
    """Until the job has left the queue (or until(), when given, is true)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until is not None and until():
            return
        q = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True
        )
        if until is None and q.returncode == 0 and not q.stdout.strip():
            return
        time.sleep(1)
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} did not finish within {timeout} s\n{logs_tail()}")


def task_states(job: str) -> list[str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    return [w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("JobState=")]


@pytest.mark.slurm
def test_array_job_on_slurm_then_merge(slurm, tmp_path, gpt2):
    spec = make_job(tmp_path, gpt2, n_rows=30)
    job = submit(spec, "--shards", "3")
    wait_for(job)
    out = tmp_path / "out"
    logs = {p.name: p.read_text() for p in (out / SLURM_DIR).glob("*.out")}
    assert task_states(job) == ["COMPLETED"] * 3, logs
    assert sorted(logs) == [f"{job}_{i}.out" for i in range(3)]
    merged = subprocess.run([*BATCHGEN, "merge", str(out)], capture_output=True, text=True)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert "total" in merged.stdout and "2/3" in merged.stdout
    ids = pq.read_table(out / MERGED_FILE).column("key").to_pylist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(30)]  # every row exactly once
    # the logs and the script are hidden: the directory reads as the rows, once
    assert sorted(pd.read_parquet(out)["key"]) == sorted(ids)


@pytest.mark.slurm
def test_spaces_in_the_output_path_and_job_name_on_slurm(slurm, tmp_path, gpt2):
    """sbatch parses #SBATCH lines itself: the quoted values must reach it whole."""
    spec = make_job(tmp_path, gpt2, n_rows=6, output=str(tmp_path / "out dir"))
    job = submit(spec, "--shards", "1", "--job-name", "my job")
    wait_for(job)
    out = tmp_path / "out dir"
    assert [p.name for p in (out / SLURM_DIR).glob("*.out")] == [f"{job}_0.out"]
    assert success(out / "shard-00000-of-00001")
    name = subprocess.run(
        ["sacct", "-n", "-X", "-j", job, "-o", "JobName%20"], capture_output=True, text=True
    ).stdout
    assert "my job" in name or not name.strip()  # sacct needs accounting, which may be off


@pytest.mark.slurm
@pytest.mark.slow  # ~27 s: two array tasks, then three merges
def test_merge_refuses_a_job_over_its_error_rate_on_slurm(slurm, tmp_path, gpt2):
    """Issue 38, item 2 on a real array: each task leaves the rate to the merge and completes;
    `batchgen merge --max-error-rate` then judges the whole job (4 null rows in 10: 40%)."""
    spec = make_job(tmp_path, gpt2, n_rows=10, max_error_rate=0.3)
    texts = [None if i % 3 == 0 else f"great product {i}" for i in range(10)]
    keys = [f"r{i:03d}" for i in range(10)]
    pq.write_table(pa.table({"key": keys, "text": texts}), tmp_path / "reviews.parquet")
    job = submit(spec, "--shards", "2")
    wait_for(job)
    out = tmp_path / "out"
    logs = {p.name: p.read_text() for p in (out / SLURM_DIR).glob("*.out")}
    assert task_states(job) == ["COMPLETED"] * 2, logs  # no task fails on its own share
    merged = subprocess.run(
        [*BATCHGEN, "merge", str(out), "--max-error-rate", "0.3"], capture_output=True, text=True
    )
    assert merged.returncode == 1, merged.stdout + merged.stderr
    assert_one_line_error(merged.stderr, "4 of 10 rows (40%)", "--max-error-rate 0.3")
    verdict = json.loads((out / VERDICT_FILE).read_text())
    assert (verdict["rows"], verdict["error_rows"], verdict["passed"]) == (10, 4, False)
    again = subprocess.run(
        [*BATCHGEN, "merge", str(out), "--max-error-rate", "0.3"], capture_output=True
    )
    assert again.returncode == 1  # the verdict holds on a rerun of the merge
    accepted = subprocess.run(
        [*BATCHGEN, "merge", str(out), "--max-error-rate", "0.4"], capture_output=True
    )
    assert accepted.returncode == 0


@pytest.mark.slurm
@pytest.mark.slow
def test_time_limit_signal_requeues_and_resumes_on_slurm(slurm, tmp_path, gpt2):
    spec = make_job(tmp_path, gpt2, **LONG_JOB)
    job = submit(spec, "--shards", "1")
    shard_dir = tmp_path / "out" / "shard-00000-of-00001"
    # bounds for a loaded machine (make test runs two test processes), not for timing
    wait_for(job, 300, until=lambda: list(shard_dir.glob("part-*.parquet")))
    # what Slurm does --grace seconds before the time limit
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job}_0"], check=True)
    wait_for(job, 300, until=lambda: "PENDING" in task_states(job))
    wait_for(job)  # it starts again after cred_expire, 10 s in the test cluster
    log = (tmp_path / "out" / SLURM_DIR / f"{job}_0.out").read_text()
    assert "requeueing" in log and "restart 1" in log, log
    assert task_states(job) == ["COMPLETED"], log
    merged = subprocess.run(
        [*BATCHGEN, "merge", str(tmp_path / "out")], capture_output=True, text=True
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert "(resumed)" in merged.stdout
    ids = pq.read_table(tmp_path / "out" / MERGED_FILE).column("key").to_pylist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(200)]


def test_the_last_user_of_the_cluster_stops_it_and_no_one_before(tmp_path, monkeypatch):
    """Two test runs share the cluster: the first to finish leaves the daemons to the other."""
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "LOCK", tmp_path / "cluster.lock")
    monkeypatch.setattr(slurm_cluster, "STATE", tmp_path / "cluster.json")
    monkeypatch.setattr(slurm_cluster, "MUTEX", tmp_path / "cluster.mutex")
    monkeypatch.setattr(slurm_cluster, "cluster_up", lambda: True)
    daemon = subprocess.Popen(["sleep", "600"])  # stands in for a daemon an earlier start began
    try:
        # exec closes the pipe Popen waits on before it renames the process: on a loaded
        # machine /proc may still say python for a moment (a daemon is long past that)
        deadline = time.monotonic() + 30
        while not slurm_cluster._is(daemon.pid, "sleep") and time.monotonic() < deadline:
            time.sleep(0.05)
        slurm_cluster.STATE.write_text(f'{{"sleep": {daemon.pid}}}')
        first, second = LocalSlurm().start(), LocalSlurm().start()
        assert first.stop() == {}
        assert daemon.poll() is None, "stopped while another run still used it"
        assert second.stop() == {"sleep": daemon.pid}
        assert daemon.wait(timeout=20) == -signal.SIGTERM
        assert not slurm_cluster.STATE.exists()
    finally:
        daemon.kill()
