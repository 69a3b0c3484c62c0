"""Kill or preempt a real `batchgen run` process mid-job, run it again: every row exactly once,
with the same results as an uninterrupted run."""

import signal
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    FAST,
    ROOT,
    cli_command,
    prompts,
    read_output,
    read_stats,
    rows_by_id,
    run_cli,
    start_cli,
    success,
    wait_for_part,
    write_parquet,
)

N = 24
# 4 sequences at a time, a part per 4 rows flushed at once: a job of 6+ parts that runs for
# several seconds.
FLAGS = (
    *FAST,
    "--max-new-tokens",
    16,
    "--ignore-eos",
    "--max-num-seqs",
    4,
    "--rows-per-part",
    4,
    "--flush-seconds",
    0,
)


KEYS = [f"key-{(i * 7) % N:02d}" for i in range(N)]  # the ids of --id-column key


@pytest.fixture(scope="module")
def job(tiny_dirs, tmp_path_factory):
    """The input and the results of an uninterrupted run of it, by row number."""
    d = tmp_path_factory.mktemp("resume")
    src = write_parquet(d / "in.parquet", {"prompt": prompts(N), "k": list(range(N)), "key": KEYS})
    model = tiny_dirs["llama"]
    run_cli("run", src, "-o", d / "clean", "--model", model, *FLAGS)
    clean = rows_by_id(d / "clean")
    assert sorted(clean) == list(range(N))
    return src, model, {i: r["generated_text"] for i, r in clean.items()}


def _check_complete(out, clean, id_column="id"):
    rows = rows_by_id(out, id_column)  # fails on a duplicate
    assert sorted(rows) == sorted(clean)
    assert {i: r["generated_text"] for i, r in rows.items()} == clean
    assert all(r["error"] is None and r["completion_tokens"] == 16 for r in rows.values())
    assert success(out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("id_column", ["id", "key"], ids=["row-numbers", "id-column"])
def test_sigkill_then_rerun_finishes_every_row_once(tmp_path, job, id_column):
    src, model, clean = job
    out = tmp_path / "out"
    args = ("run", src, "-o", out, "--model", model, *FLAGS)
    if id_column != "id":  # the same rows under their own ids (greedy: the same texts)
        args = (*args, "--id-column", id_column)
        clean = {KEYS[i]: text for i, text in clean.items()}
    proc = start_cli(*args)
    wait_for_part(out, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not success(out)
    done = set(read_output(out).column(id_column).to_pylist())
    assert 0 < len(done) < N, "the kill should land mid-job"
    parts_before = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}

    # What a kill mid-write leaves: temp files, one complete and one cut short, holding rows
    # that are not done. Neither may count as done, nor reach the output.
    todo = sorted(set(clean) - done)[:4]
    table = read_output(out)
    row = table.to_pylist()[0]
    bogus = [{**row, id_column: i, "generated_text": "BOGUS"} for i in todo]
    pq.write_table(
        pa.Table.from_pylist(bogus, schema=table.schema), out / ".tmp-part-00090.parquet.abc123"
    )
    data = (out / ".tmp-part-00090.parquet.abc123").read_bytes()
    (out / ".tmp-part-00091.parquet.def456").write_bytes(data[: len(data) // 2])

    rerun = subprocess.run(
        cli_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr
    _check_complete(out, clean, id_column)
    for name, data in parts_before.items():  # finished parts are kept as they were
        assert (out / name).read_bytes() == data
    stats = read_stats(out)
    assert stats["rows_skipped_done"] == len(done)
    assert stats["rows"] == N - len(done)


def test_sigterm_saves_finished_rows_and_says_rerun(tmp_path, job):
    src, model, clean = job
    out = tmp_path / "out"
    args = ("run", src, "-o", out, "--model", model, *FLAGS)
    proc = start_cli(*args)
    wait_for_part(out, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM == 143
    assert "SIGTERM" in stderr and "run the same command again to resume" in stderr
    assert "Traceback" not in stderr

    saved = rows_by_id(out)
    assert 0 < len(saved) < N, "SIGTERM should land mid-job"
    assert all(r["generated_text"] == clean[i] for i, r in saved.items())  # finished rows are whole
    assert not success(out)
    stats = read_stats(out)
    assert stats["complete"] is False
    assert stats["rows"] == len(saved)  # every finished row was flushed

    run_cli(*args)  # the same command again
    _check_complete(out, clean)
    assert read_stats(out)["rows_skipped_done"] == len(saved)


def test_rerun_of_a_complete_job_changes_nothing(tmp_path, job):
    src, model, clean = job
    out = tmp_path / "out"
    args = ("run", src, "-o", out, "--model", model, *FAST, "--max-new-tokens", 2)
    run_cli(*args)
    parts = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    run_cli(*args)
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == parts
    assert sorted(rows_by_id(out)) == list(range(N))
