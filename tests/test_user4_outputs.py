"""An output directory holds one job's result rows and nothing a reader takes for them (issue
38, items 3-6): a sharded and an unsharded run are two jobs, never one output."""

from __future__ import annotations

import shutil

from helpers import assert_one_line_error, listing, prompt_file, run_cli, run_job, success

from batchgen.data.layout import MERGED_FILE


def test_a_sharded_run_into_an_unsharded_jobs_output_is_refused(tmp_path, model):
    src, out = prompt_file(tmp_path, 6), tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2)
    before = listing(out)
    r = run_job(src, out, model, "--max-new-tokens", 2, "--shard", "0/2", exit_code=2)
    assert_one_line_error(r, "without --shard", "another job", "pick another output")
    assert listing(out) == before  # no shard folder, nothing moved


def test_an_unsharded_run_into_a_sharded_output_is_refused(tmp_path, model):
    src, out = prompt_file(tmp_path, 6), tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2, "--shard", "1/2")
    before = listing(out)
    r = run_job(src, out, model, "--max-new-tokens", 2, exit_code=2)
    assert_one_line_error(r, "2-way sharded run", "--shard I/2")
    assert listing(out) == before
    r = run_job(src, out, model, "--max-new-tokens", 2, "--shard", "0/3", exit_code=2)
    assert_one_line_error(r, "2-way split", "--shard I/2")


def test_merge_refuses_a_directory_of_both(tmp_path, model):
    # what the README's block made: the unsharded run, then shards beside it (here put there
    # by hand, as an older batchgen let them be written)
    src, out, sharded = prompt_file(tmp_path, 6), tmp_path / "out", tmp_path / "sharded"
    run_job(src, out, model, "--max-new-tokens", 2)
    for i in range(2):
        run_job(src, sharded, model, "--max-new-tokens", 2, "--shard", f"{i}/2")
        name = f"shard-{i:05d}-of-00002"
        shutil.move(sharded / name, out / name)
    before = listing(out)
    r = run_cli("merge", out, exit_code=1)
    assert_one_line_error(r, "without --shard beside shard folders")
    assert listing(out) == before and not (out / MERGED_FILE).exists()
    assert success(out / "shard-00000-of-00002")  # the shards themselves are fine
