"""The output directory keeps what a user has in it (audit, issue 32): an input inside it is
refused before anything there is deleted, and a planted `_lock` link is never followed."""

import os

import pytest
from helpers import assert_one_line_error, prompts, run_job, write_parquet

from batchgen.data.lock import LOCK_FILE


@pytest.fixture
def finished(tmp_path, model):
    """A finished job's output directory."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "chain"
    run_job(src, out, model, "--max-new-tokens", 2)
    return out


def _files(d):
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in d.rglob("*")
        if p.is_file() and p.name != LOCK_FILE
    }


def _lock_path(out, src, model):
    """Where batchgen keeps OUT's lock: found after a first run into OUT, then removed."""
    run_job(src, out, model, "--max-new-tokens", 2)
    (lock,) = out.rglob(LOCK_FILE)
    lock.unlink()
    return lock


def test_overwrite_refuses_the_output_as_its_own_input(finished, model):
    before = _files(finished)
    r = run_job(finished, finished, model, "-t", "{{ text }} again", "--overwrite", exit_code=2)
    assert_one_line_error(r, "inside the output directory", "-o")
    assert _files(finished) == before  # nothing deleted


def test_overwrite_refuses_an_input_file_inside_the_output(finished, model, tmp_path):
    part = finished / "part-00000.parquet"
    before = _files(finished)
    r = run_job(part, finished, model, "--overwrite", exit_code=2)
    assert_one_line_error(r, "part-00000.parquet", "inside the output directory")
    assert _files(finished) == before
    # The same input through a link from outside is the same file.
    link = tmp_path / "link.parquet"
    link.symlink_to(part)
    assert_one_line_error(run_job(link, finished, model, "--overwrite", exit_code=2), "inside")
    assert _files(finished) == before


def test_lock_link_is_not_followed(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    lock = _lock_path(tmp_path / "s", src, model)
    lock.symlink_to(victim)
    r = run_job(src, tmp_path / "s", model, "--max-new-tokens", 2, exit_code=2)
    assert_one_line_error(r, "_lock", "not a regular file")
    assert victim.read_text() == "keep me\n"

    # A dangling link does not create its target.
    lock.unlink()
    lock.symlink_to(tmp_path / "created.txt")
    run_job(src, tmp_path / "s", model, "--max-new-tokens", 2, exit_code=2)
    assert not (tmp_path / "created.txt").exists()


@pytest.mark.parametrize("kind", ["hardlink", "fifo", "dir"])
def test_lock_that_is_not_a_plain_file_is_refused(tmp_path, model, kind):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    out = tmp_path / "s"
    lock = _lock_path(out, src, model)
    if kind == "hardlink":
        victim = tmp_path / "victim.txt"
        victim.write_text("keep me\n")
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    r = run_job(src, out, model, "--max-new-tokens", 2, exit_code=2)
    assert_one_line_error(r, "_lock", "not a regular file")
    if kind == "hardlink":
        assert victim.read_text() == "keep me\n"


def test_lock_still_taken_and_rerun_resumes(finished, model):
    """The plain case is unchanged: the lock file holds the last run's pid."""
    src = finished.parent / "in.parquet"
    r = run_job(src, finished, model, "--max-new-tokens", 2)
    assert r.exit_code == 0
    (lock,) = finished.rglob(LOCK_FILE)
    assert lock.read_text().strip().isdigit()
