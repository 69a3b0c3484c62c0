"""Failures a user can see (issue 31): error reasons grouped with counts at the end of a run,
--max-error-rate's exit 1 once every row is written, the error count in the progress, and a
periodic progress line where stderr is a log."""

from __future__ import annotations

import os
import subprocess

from helpers import (
    DEVICE_FLAGS,
    FAST,
    assert_one_line_error,
    cli_command,
    read_stats,
    rows_by_id,
    run_job,
    success,
    write_parquet,
)


def _source(tmp_path, good: int, bad: int):
    """good prompts and bad rows (null prompts)."""
    return write_parquet(
        tmp_path / "in.parquet",
        {"prompt": [f"the quick brown fox {i}" for i in range(good)] + [None] * bad},
    )


def test_error_rows_over_the_rate_exit_1_after_writing_everything(tmp_path, model):
    src, out = _source(tmp_path, good=6, bad=4), tmp_path / "out"
    flags = ("--max-new-tokens", 2, "--max-error-rate", 0.1)
    r = run_job(src, out, model, *flags, exit_code=1)
    assert_one_line_error(r, "4 of 10 rows", "--max-error-rate 0.1")
    assert "error rows by reason" in r.stderr and "4 x " in r.stderr
    assert success(out) and len(rows_by_id(out)) == 10  # everything written first
    reasons = read_stats(out)["error_reasons"]
    assert sum(reasons.values()) == 4 and len(reasons) == 1, reasons


def test_a_rate_at_or_under_the_limit_exits_0(tmp_path, model):
    src = _source(tmp_path, good=6, bad=4)
    run_job(src, tmp_path / "a", model, "--max-error-rate", 1)
    run_job(src, tmp_path / "b", model, "--max-error-rate", 0.4)
    run_job(_source(tmp_path, good=5, bad=0), tmp_path / "c", model, "--max-error-rate", 0)


def test_every_row_failed_exits_1_and_the_table_lists_reasons(tmp_path, model):
    src, out = _source(tmp_path, good=0, bad=3), tmp_path / "out"
    # not quiet: the table; the default --max-error-rate
    cmd = cli_command("run", src, "-o", out, "--model", model, *DEVICE_FLAGS)
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    assert_one_line_error(p.stderr, "3 of 3 rows (100%)")
    assert "error rows (3), by reason:" in p.stdout and "3 x " in p.stdout


def test_a_progress_line_where_stderr_is_a_log(tmp_path, model):
    src, out = _source(tmp_path, good=8, bad=1), tmp_path / "out"
    cmd = cli_command("run", src, "-o", out, "--model", model, *FAST)
    env = {**os.environ, "BATCHGEN_PROGRESS_SECONDS": "1e-9"}  # every batch of finished rows
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    lines = [x for x in p.stderr.splitlines() if x.startswith("batchgen: ")]
    assert lines, p.stderr
    assert "/9 rows" in lines[-1] and "out tok/s" in lines[-1] and "ETA" in lines[-1]
    assert "1 errors" in lines[-1]
