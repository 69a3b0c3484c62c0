"""Audit 2, item 18: the step timeline grows by a part file per flush (each holding only the
steps since the last) instead of being rewritten whole; the report reads the parts, or an older
output's single file, and bins them with numpy."""

import shutil

import pyarrow.parquet as pq
from helpers import prompts, read_stats, run_cli, run_job, write_parquet

from batchgen.data.layout import REPORT_FILE, STEPS_FILE
from batchgen.report.load import load
from batchgen.stats.steps import OLD_STEPS_FILE, STEPS_DIR, read_steps, steps_files


def test_each_flush_appends_only_its_steps(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(6)})
    out = tmp_path / "out"
    flags = ("--max-new-tokens", 6, "--max-num-seqs", 2, "--rows-per-part", 1)
    run_job(src, out, model, *flags, "--flush-seconds", 0)  # a flush after every step
    parts = steps_files(out)
    assert len(parts) > 2 and all(p.parent == out / STEPS_DIR for p in parts)
    assert not (out / STEPS_FILE).exists()
    sizes = [pq.read_metadata(p).num_rows for p in parts]
    t = read_steps(out).column("t_s").to_pylist()
    assert sum(sizes) == len(t) == read_stats(out)["steps"]  # every step once
    assert t == sorted(t)
    # a rerun starts the timeline anew, as stats.json
    run_job(src, out, model, *flags, "--overwrite")
    assert len(steps_files(out)) == 1 and len(read_steps(out)) == read_stats(out)["steps"]


def test_an_older_outputs_single_timeline_file_still_reads(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 3)
    table = read_steps(out)
    pq.write_table(table, out / OLD_STEPS_FILE)  # as batchgen wrote it before
    shutil.rmtree(out / STEPS_DIR)
    assert steps_files(out) == [out / OLD_STEPS_FILE]
    assert len(load(out).steps["t_s"]) == len(table)
    run_cli("report", out)
    assert "Throughput" in (out / REPORT_FILE).read_text()
