"""Data passed as good (issue 38, items 1 and 2): --max-error-rate counts every row written with
an error (a constrained row cut at max_new_tokens too), stats.json's reasons agree with its
count, and the error-rate verdict is recorded beside SUCCESS and holds on every rerun."""

from __future__ import annotations

import json

from helpers import (
    assert_one_line_error,
    prompt_file,
    prompts,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    success,
    write_parquet,
)

from batchgen.data.layout import VERDICT_FILE

# Two tokens cannot spell eight letters: every row is cut at max_new_tokens, short of its regex.
CUT = ("--regex", "[a-c]{8}", "--max-new-tokens", 2)


def test_rows_cut_short_under_a_constraint_count_against_the_rate(tmp_path, model):
    src, out = prompt_file(tmp_path, 4), tmp_path / "out"
    r = run_job(src, out, model, *CUT, "--max-error-rate", 0, exit_code=1)
    assert_one_line_error(r, "4 of 4 rows (100%)", "--max-error-rate 0")
    rows = rows_by_id(out)
    assert all(v["finish_reason"] == "length" and v["error"] for v in rows.values())
    stats = read_stats(out)
    assert stats["rows_error"] == 4 and sum(stats["error_reasons"].values()) == 4, stats
    assert "does not complete the constraint" in next(iter(stats["error_reasons"]))


def test_a_failed_verdict_holds_on_rerun_until_the_user_accepts_it(tmp_path, model):
    src, out = prompt_file(tmp_path, 3), tmp_path / "out"
    first = run_job(src, out, model, *CUT, "--max-error-rate", 0.5, exit_code=1)
    line = first.stderr.strip().splitlines()[-1]
    assert success(out)  # complete: every row is there, once
    verdict = json.loads((out / VERDICT_FILE).read_text())
    assert verdict["rows"] == 3 and verdict["error_rows"] == 3 and verdict["passed"] is False
    # the same command again (Make, Airflow, a Slurm requeue): the same verdict, not exit 0
    again = run_job(src, out, model, *CUT, "--max-error-rate", 0.5, exit_code=1)
    assert again.stderr.strip().splitlines()[-1] == line
    # the user accepts the errors: exit 0, and the file says so
    run_job(src, out, model, *CUT, "--max-error-rate", 1)
    assert json.loads((out / VERDICT_FILE).read_text())["passed"] is True


def test_the_verdict_counts_the_whole_job_across_a_resume(tmp_path, model):
    # 2 good rows under --limit 2, then the job continued with 3 null prompts: the verdict is
    # the job's (3 of 5), not the last run's (3 of 3)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2) + [None] * 3})
    out = tmp_path / "out"
    run_job(src, out, model, "--limit", 2, "--max-error-rate", 0)
    r = run_job(src, out, model, "--max-error-rate", 0.5, exit_code=1)
    assert_one_line_error(r, "3 of 5 rows (60%)")
    run_job(src, out, model, "--max-error-rate", 0.6)


def test_workers_judge_the_jobs_error_rate_once_over_every_shard(tmp_path, model):
    # 3 null prompts in 8 rows: 38% of the job, whatever share each shard got
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(5) + [None] * 3})
    out, workers = tmp_path / "out", ("--workers", 2, "--device", "cpu")
    r = run_job(src, out, model, *workers, "--max-error-rate", 0.3, exit_code=1)
    assert_one_line_error(r, "3 of 8 rows (38%)", "--max-error-rate 0.3")
    assert success(out) and json.loads((out / VERDICT_FILE).read_text())["passed"] is False
    run_job(src, out, model, *workers, "--max-error-rate", 0.4)  # a rerun, accepted


def test_merge_judges_the_error_rate_once_over_every_shard(tmp_path, model):
    # a Slurm array's shards, each run as its task runs it (--max-error-rate 1: no task fails
    # on its own shard's share); the merge judges the job: 3 null prompts in 8 rows, 38%
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(5) + [None] * 3})
    out = tmp_path / "out"
    for shard in ("0/2", "1/2"):
        run_job(src, out, model, "--shard", shard, "--max-error-rate", 1)
    r = run_cli("merge", out, "--max-error-rate", 0.3, exit_code=1)
    assert_one_line_error(r, "3 of 8 rows (38%)", "--max-error-rate 0.3")
    assert "error rows by reason:" in r.stderr and "total" in r.stdout
    verdict = json.loads((out / VERDICT_FILE).read_text())
    assert (verdict["rows"], verdict["error_rows"], verdict["passed"]) == (8, 3, False)
    assert success(out)  # merged: every row is there, once; the verdict says they fail
    run_cli("merge", out, "--max-error-rate", 0.4)  # accepted
    assert json.loads((out / VERDICT_FILE).read_text())["passed"] is True
    run_cli("merge", out)  # no rate asked: no verdict, and no stale one left behind
    assert not (out / VERDICT_FILE).exists() and success(out)
