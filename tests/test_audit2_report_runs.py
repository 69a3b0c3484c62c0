"""Audit 2, item 17: `batchgen report` says when its figures do not cover the whole job: a run
is writing the output now (its lock is held: the table is the previous run's), or the job was
resumed (the figures are its last run's)."""

import logging

from helpers import prompts, run_cli, run_job, write_parquet

from batchgen.data.layout import META_DIR, REPORT_FILE
from batchgen.data.lock import lock_directory


def _report(out, caplog) -> tuple[str, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_cli("report", out)
    return (out / REPORT_FILE).read_text(), caplog.text


def test_a_report_says_a_run_is_writing_the_output(tmp_path, model, caplog):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2)
    page, log = _report(out, caplog)
    assert "Note:" not in page and "resumed" not in log
    lock = lock_directory(str(out / META_DIR))  # as a running rerun holds it
    try:
        page, log = _report(out, caplog)
    finally:
        lock.close()
    assert "is writing this output now" in page and "previous run" in page
    assert "is writing this output now" in log


def test_a_report_of_a_resumed_job_says_so(tmp_path, model, caplog):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2, "--limit", 2)
    run_job(src, out, model, "--max-new-tokens", 2)  # resumes: 2 rows done before
    page, log = _report(out, caplog)
    assert "this output was resumed" in page and "2 rows were done by earlier runs" in page
    assert "this output was resumed" in log
