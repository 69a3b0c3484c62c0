"""Output integrity under reruns, concurrency and changed files (issue 11), through the real CLI:
every id exactly once, SUCCESS only over complete results, and a one-line error otherwise."""

import errno
import os
import shutil
import signal
import subprocess

import pyarrow.parquet as pq
from helpers import (
    FAST,
    ROOT,
    assert_one_line_error,
    cli_command,
    prompt_file,
    prompts,
    read_job,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    start_cli,
    success,
    wait_for_part,
    write_parquet,
)

from batchgen.data.layout import MERGED_FILE, META_DIR, STATS_FILE, SUCCESS_FILE

N = 60


def _job(tmp_path, model, n=N, *flags):
    src = prompt_file(tmp_path, n)
    out = tmp_path / "out"
    return ("run", src, "-o", out, "--model", model, *FAST, "--max-new-tokens", 2, *flags), out


def _complete(out, n=N):
    rows = rows_by_id(out)  # fails on a duplicate id
    assert sorted(rows) == list(range(n))
    assert success(out)


# --- 1. a damaged part is never followed by "complete" ---


def test_damaged_part_of_a_complete_job_is_redone(tmp_path, model, caplog):
    args, out = _job(tmp_path, model, N, "--rows-per-part", 10)
    run_cli(*args)
    part = out / "part-00002.parquet"
    part.write_bytes(part.read_bytes()[:-100])
    caplog.clear()
    run_cli(*args)
    assert "will be redone" in caplog.text
    assert "complete results" not in caplog.text
    _complete(out)
    assert read_stats(out)["rows"] == 10  # the damaged part's rows, and only those


# --- 4. one run per output directory ---


def test_second_run_on_a_locked_output_fails_naming_the_holder(tmp_path, model):
    # One part per batch of 4, flushed at once: a job that runs for several seconds.
    args, out = _job(
        tmp_path,
        model,
        24,
        "--rows-per-part",
        4,
        "--flush-seconds",
        0,
        "--max-num-seqs",
        4,
        "--max-new-tokens",
        16,
        "--ignore-eos",
    )
    first = start_cli(*args)
    wait_for_part(out, first)
    first.send_signal(signal.SIGSTOP)  # frozen mid-job, holding the lock
    try:
        second = subprocess.run(
            cli_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=300
        )
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 1, second.stderr
    assert_one_line_error(second, "in use by another batchgen run", f"pid {first.pid}")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    _complete(out, 24)
    run_cli(*args)  # the lock went with the process: a rerun finds the job complete


def test_part_sizes_and_windows_may_change_between_runs(tmp_path, model):
    """rows_per_part, window_rows and max_num_seqs are not in the fingerprint: resuming with
    others cuts parts differently, and still writes every row once."""
    args, out = _job(tmp_path, model, N, "--rows-per-part", 10)
    run_cli(*args)
    for name in ("part-00001.parquet", "part-00004.parquet", SUCCESS_FILE):
        (out / name).unlink()  # what a kill after four parts would have left, roughly
    run_cli(*args[:-2], "--rows-per-part", 7, "--window-rows", 5, "--max-num-seqs", 3)
    _complete(out)


def test_workers_refuse_an_output_of_another_split(tmp_path, model):
    src = prompt_file(tmp_path, 4)
    out = tmp_path / "out"
    (out / "shard-00000-of-00003").mkdir(parents=True)
    r = run_job(src, out, model, "--workers", 2, exit_code=2)
    assert_one_line_error(r, "3-way split", "--workers 3")


# --- 5. ownership before any deletion ---


def test_foreign_temp_entries_are_neither_deleted_nor_taken_as_ours(tmp_path, model):
    args, out = _job(tmp_path, model, 4)
    out.mkdir()
    (out / ".tmp-notes").write_text("someone's")
    (out / ".tmp-build").mkdir()
    r = run_cli(*args, "--overwrite", exit_code=2)
    assert_one_line_error(r, "not written by batchgen", ".tmp-build")
    assert (out / ".tmp-notes").read_text() == "someone's" and (out / ".tmp-build").is_dir()
    assert sorted(p.name for p in out.iterdir()) == [".tmp-build", ".tmp-notes"]


# --- 6. same paths, other contents ---


def test_changed_weights_at_the_same_model_path_are_refused(tmp_path, model):
    copy = shutil.copytree(model, tmp_path / "model")
    args, out = _job(tmp_path, copy, 8)
    run_cli(*args)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten in place: same size, new mtime
    r = run_cli(*args, exit_code=2)
    assert_one_line_error(r, "another job", "model_files", "--overwrite")
    run_cli(*args, "--overwrite")
    _complete(out, 8)


def test_rows_prepended_to_the_input_are_refused(tmp_path, model):
    args, out = _job(tmp_path, model, 8)
    run_cli(*args)
    write_parquet(tmp_path / "in.parquet", {"prompt": ["a new first row", *prompts(8)]})
    r = run_cli(*args, exit_code=2)
    assert_one_line_error(r, "another job", "input_files", "--overwrite")
    assert sorted(rows_by_id(out)) == list(range(8))  # untouched


def test_another_id_column_is_another_job(tmp_path, model):
    """The id column is part of the job: a rerun naming another one is refused, and so are
    parts that hold the ids under another name (an older batchgen wrote every id as `id`)."""
    keys = [f"k{i}" for i in range(8)]
    cols = {"a": keys, "b": keys[::-1], "prompt": prompts(8)}
    src = write_parquet(tmp_path / "in.parquet", cols)
    out = tmp_path / "out"
    args = (src, out, model, "--max-new-tokens", 2, "--rows-per-part", 4)
    run_job(*args, "--id-column", "a")
    for other in (("--id-column", "b"), ()):  # another column, or row numbers
        r = run_job(*args, *other, exit_code=2)
        assert_one_line_error(r, "another job", "id_column", "--overwrite")
    part = out / "part-00000.parquet"
    old = pq.read_table(part)
    pq.write_table(old.rename_columns(["id", *old.column_names[1:]]), part)
    (out / SUCCESS_FILE).unlink()
    r = run_job(*args, "--id-column", "a", exit_code=2)
    assert_one_line_error(r, "has no id column 'a'", "--overwrite")
    assert pq.read_table(part).equals(old.rename_columns(["id", *old.column_names[1:]]))
    run_job(*args, "--id-column", "a", "--overwrite")
    assert sorted(rows_by_id(out, "a")) == sorted(keys)


# --- 7. a job that never ran does not keep the directory ---


def test_job_refused_before_writing_can_rerun_with_the_fix(tmp_path, model):
    import torch
    from safetensors.torch import load_file

    pickled = shutil.copytree(model, tmp_path / "model")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    args, out = _job(tmp_path, pickled, 4)
    r = run_cli(*args, exit_code=2)
    assert_one_line_error(r, "--allow-pickle")
    run_cli(*args, "--allow-pickle")  # the fix the message names, same -o
    _complete(out, 4)


# --- 12. merge writes like the parts ---


def test_merged_files_are_durable_and_follow_the_umask(tmp_path, monkeypatch):
    from test_merge import split, write_shard

    from batchgen.job.shard import Shard
    from batchgen.scaleout.merge import merge

    out = tmp_path / "out"
    for i, ids in split(list(range(10)), 2).items():
        write_shard(out, Shard(i, 2), ids).close()
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    merge(out)
    umask = os.umask(0)
    os.umask(umask)
    for name in (MERGED_FILE, STATS_FILE, SUCCESS_FILE):
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
        temp = f".tmp-{os.path.basename(name)}."
        assert any(os.path.basename(s).startswith(temp) for s in synced), name
    assert synced.count(str(out / META_DIR)) >= 3  # and each rename's directory entry
    assert pq.read_table(out / MERGED_FILE).num_rows == 10
    assert not list(out.rglob(".tmp-*"))


# --- 13. output failures are one line with the fix ---


def test_full_disk_is_a_one_line_error_and_a_rerun_resumes(tmp_path, model, monkeypatch):
    args, out = _job(tmp_path, model, 8)

    def disk_full(table, where, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("batchgen.data.writer.pq.write_table", disk_full)
    r = run_cli(*args, exit_code=1)
    assert_one_line_error(r, "No space left on device", "run the same command again to resume")
    assert not success(out)
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.undo()
    run_cli(*args)
    _complete(out, 8)


def test_unwritable_empty_or_file_output_is_aassert_one_line_error(tmp_path, model, monkeypatch):
    src = prompt_file(tmp_path, 2)
    common = ("--model", model, *FAST)
    r = run_cli("run", src, "-o", "", *common, exit_code=2)
    assert_one_line_error(r, "output is empty")
    (tmp_path / "file").write_text("")
    r = run_cli("run", src, "-o", tmp_path / "file" / "out", *common, exit_code=2)
    assert_one_line_error(r, "cannot create output", "pick another output directory")
    # A read-only file system (simulated: root may write anywhere on this one).
    ro = tmp_path / "ro"
    real = os.makedirs

    def makedirs(path, *a, **kw):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "makedirs", makedirs)
    r = run_cli("run", src, "-o", ro / "out", *common, exit_code=2)
    assert_one_line_error(r, "Read-only file system", "pick another output directory")


def test_run_help_documents_the_exit_codes():
    text = run_cli("run", "--help").stdout
    assert "Exit codes:" in text
    codes = [
        line.split()[0]
        for line in text.split("Exit codes:")[1].splitlines()
        if line[4:5] != " " and line.strip()
    ]
    assert codes == ["0", "1", "2", "128+N"]
    readme = (ROOT / "README.md").read_text()
    assert "Exit codes" in readme and "128+N" in readme


def test_job_file_records_the_model_and_input_contents(tmp_path, model):
    args, out = _job(tmp_path, model, 2)
    run_cli(*args)
    job = read_job(out)
    assert job["model_files"]["config.json"].startswith("sha256:")
    assert len(job["model_files"]["model.safetensors"]) == 2  # size, mtime
    ((path, size, _mtime),) = job["input_files"]
    assert path == str(tmp_path / "in.parquet") and size == (tmp_path / "in.parquet").stat().st_size
