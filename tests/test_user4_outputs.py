"""An output directory holds one job's result rows and nothing a reader takes for them (issue
38, items 3-6): a sharded and an unsharded run are two jobs, never one output."""

from __future__ import annotations

import shutil

from helpers import (
    assert_one_line_error,
    listing,
    prompt_file,
    rows_by_id,
    run_cli,
    run_job,
    success,
)

from batchgen.data.layout import MERGED_FILE, META_DIR, STEPS_DIR, SUCCESS_FILE


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


def _two_outputs(tmp_path, model):
    """A finished output `a` (the victim) and a finished output `out` of another job."""
    src = prompt_file(tmp_path, 6)
    run_job(src, tmp_path / "a", model, "--max-new-tokens", 2)
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 3)
    return src, tmp_path / "a", tmp_path / "out"


def test_a_symlinked_meta_folder_is_refused_not_followed(tmp_path, model):
    src, a, out = _two_outputs(tmp_path, model)
    before = listing(a)
    shutil.rmtree(out / META_DIR)
    (out / META_DIR).symlink_to(a / META_DIR)  # --overwrite would empty a's folder
    r = run_job(src, out, model, "--max-new-tokens", 3, "--overwrite", exit_code=2)
    assert_one_line_error(r, f"{out / META_DIR} is a symbolic link", "remove the link")
    for command in ("merge", "report"):
        r = run_cli(command, out, exit_code=None)
        assert r.exit_code != 0 and "is a symbolic link" in r.stderr, r.stderr
    assert listing(a) == before


def test_a_symlinked_steps_folder_is_refused_not_followed(tmp_path, model):
    src, a, out = _two_outputs(tmp_path, model)
    before = {p: (a / p).read_bytes() for p in listing(a) if p.startswith(STEPS_DIR)}
    shutil.rmtree(out / STEPS_DIR)
    (out / STEPS_DIR).symlink_to(a / STEPS_DIR)  # a rerun would write its parts into a's
    r = run_job(src, out, model, "--max-new-tokens", 3, "--overwrite", exit_code=2)
    assert_one_line_error(r, "is a symbolic link")
    assert {p: (a / p).read_bytes() for p in before} == before


def test_a_meta_file_in_place_of_the_folder_is_named(tmp_path, model):
    out = tmp_path / "out"
    out.mkdir()
    (out / META_DIR).write_text("not a folder")
    r = run_job(prompt_file(tmp_path, 2), out, model, exit_code=2)
    assert_one_line_error(r, f"{out / META_DIR} is a file", "move it away")


def test_a_foreign_folders_files_stay_where_they_are(tmp_path, model):
    # someone's vllm run-batch output and report: not batchgen 0.1's (no _job.json)
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "results.jsonl").write_text('{"id": 1}\n')
    (out / "report.html").write_text("<p>mine</p>")
    r = run_job(prompt_file(tmp_path, 2), out, model, exit_code=2)
    assert_one_line_error(r, "not written by batchgen", "report.html, results.jsonl")
    for command in ("merge", "report"):
        assert run_cli(command, out, exit_code=None).exit_code != 0
    assert listing(out) == ["report.html", "results.jsonl"]


def test_a_stray_top_level_success_marker_is_not_batchgens(tmp_path, model):
    # a job killed with 5 of 20 rows to do, then Spark's or Hadoop's _SUCCESS at the top
    src, out = prompt_file(tmp_path, 20), tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2, "--rows-per-part", 5)
    (out / SUCCESS_FILE).unlink()
    (out / "part-00003.parquet").unlink()
    (out / "_SUCCESS").write_text("")
    r = run_job(src, out, model, "--max-new-tokens", 2, "--rows-per-part", 5)
    assert "were done before" not in r.stdout and "5 rows" in r.stdout, r.stdout
    assert len(rows_by_id(out)) == 20 and success(out)
    assert (out / "_SUCCESS").exists()  # not ours: left alone
