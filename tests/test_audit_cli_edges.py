"""One clear line and the right exit code where the audit (issue 32) found a traceback, a
silent drop or a wrong code: --device, empty score labels, `batchgen slurm`'s numbers and a
failed sbatch, `merge`/`report` on what is not a finished output."""

import os

import pytest
from helpers import assert_one_line_error, prompts, run_cli, run_job, write_parquet

from batchgen.data.layout import SLURM_DIR
from batchgen.data.writer import JOB_FILE, STATS_FILE, SUCCESS_FILE
from batchgen.stats.steps import STEPS_DIR


@pytest.fixture
def src(tmp_path):
    return write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})


@pytest.fixture
def finished(tmp_path, src, model):
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2)
    return out


def test_an_unknown_device_is_a_usage_error(src, model, tmp_path):
    r = run_job(src, tmp_path / "out", model, "--device", "foo", exit_code=2)
    assert_one_line_error(r, "'foo'", "cpu", "cuda")


@pytest.mark.parametrize("choice", ["yes,,no", "yes, ,no"])
def test_a_score_job_refuses_an_empty_label(src, model, tmp_path, choice):
    flags = ("--task", "score", "--choice", choice)
    r = run_job(src, tmp_path / "out", model, *flags, exit_code=2)
    assert_one_line_error(r, "empty label")
    assert not (tmp_path / "out").exists()


def _slurm(src, tmp_path, *args, exit_code):
    run_flags = ("-o", tmp_path / "sout", "--model", tmp_path / "model", "--device", "cpu")
    return run_cli("slurm", src, "--shards", 2, *args, "--", *run_flags, exit_code=exit_code)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--grace", "-5"), ["--grace", ">= 0"]),
        (("--max-parallel", "0"), ["--max-parallel", ">= 1"]),
        (("--only", "a"), ["--only 'a'", "2,5"]),
        (("--only", "0,,1"), ["--only", "comma-separated"]),
    ],
)
def test_slurm_refuses_bad_numbers_in_one_line(src, tmp_path, args, words):
    r = _slurm(src, tmp_path, "--dry-run", *args, exit_code=2)
    assert_one_line_error(r, *words)
    assert "invalid literal" not in r.stderr


def test_slurm_grace_zero_is_written(src, tmp_path):
    r = _slurm(src, tmp_path, "--dry-run", "--grace", "0", exit_code=0)
    assert "#SBATCH --signal=B:USR1@0" in r.stdout


def test_a_failed_sbatch_is_a_runtime_failure(src, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = _slurm(src, tmp_path, exit_code=1)
    assert_one_line_error(r, "sbatch failed", "invalid partition")


def test_the_sbatch_script_replaces_a_planted_link(src, tmp_path, fake_sbatch):
    """The script is written under a new name and renamed: a link there is not followed."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    logs = tmp_path / "sout" / SLURM_DIR
    logs.mkdir(parents=True)
    (logs / "batchgen.sbatch").symlink_to(victim)
    fake_sbatch("echo 4242")
    _slurm(src, tmp_path, exit_code=0)
    assert victim.read_text() == "keep me\n"
    assert not (logs / "batchgen.sbatch").is_symlink()


@pytest.mark.parametrize("command", ["merge", "report"])
def test_merge_and_report_on_a_missing_directory(tmp_path, command):
    r = run_cli(command, tmp_path / "nonexist", exit_code=2)
    assert_one_line_error(r, "no such directory")


def test_report_on_a_killed_first_run_says_it_is_unfinished(finished):
    for name in (STATS_FILE, SUCCESS_FILE):  # as if killed before its end
        (finished / name).unlink(missing_ok=True)
    assert (finished / JOB_FILE).exists()
    r = run_cli("report", finished, exit_code=2)
    assert_one_line_error(r, "unfinished run", "same `batchgen run` command")
    assert "not a batchgen output" not in r.stderr


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        (f"{STEPS_DIR}/steps-00000.pq", b"PAR1 not", ["cannot read the step timeline"]),
        (STATS_FILE, b"[1, 2]", ["JSON list", "run the job again"]),
        (STATS_FILE, b'{"output_tokens_per_s": "fast"}', ["do not hold what batchgen writes"]),
    ],
)
def test_report_on_corrupt_files_is_one_line(finished, name, content, words):
    (finished / name).write_bytes(content)
    r = run_cli("report", finished, exit_code=2)
    assert_one_line_error(r, *words)
