"""An output directory stays a dataset (issue 31 A): after `run`, `report`, `merge` and
`--output-format openai`, every installed reader sees exactly the result rows, once."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from helpers import run_cli, run_job, write_jsonl, write_parquet

from batchgen.data.layout import (
    JOB_FILE,
    LOCK_FILE,
    LOCK_PATH,
    MERGED_FILE,
    META_DIR,
    REPORT_FILE,
    RESULTS_FILE,
    STATS_FILE,
    STEPS_DIR,
    STEPS_FILE,
    SUCCESS_FILE,
    VERDICT_FILE,
    steps_part_name,
)

N = 6
FLAGS = ("--max-new-tokens", "2")


def _datasets_rows(out, cache) -> list:
    datasets = pytest.importorskip("datasets")
    d = datasets.load_dataset("parquet", data_dir=str(out), cache_dir=str(cache))
    assert list(d) == ["train"]
    return d["train"]["id"]


def assert_dataset(out, ids, tmp_path, glob_ids=None) -> None:
    """pandas, pyarrow, datasets (and DuckDB where installed) read `ids` from OUT, each once;
    an OUT/*.parquet glob reads `glob_ids` (default: the same)."""
    glob_ids = ids if glob_ids is None else glob_ids
    want = sorted(ids)
    assert sorted(pd.read_parquet(out)["id"]) == want
    assert sorted(ds.dataset(out).to_table().column("id").to_pylist()) == want
    assert sorted(_datasets_rows(out, tmp_path / "hf-cache")) == want
    files = glob.glob(os.path.join(out, "*.parquet"))
    got = [i for f in files for i in pq.read_table(f).column("id").to_pylist()]
    assert sorted(got) == sorted(glob_ids)
    # DuckDB's globs match hidden names too: no hidden file may end in .parquet at any depth,
    # so OUT/**/*.parquet reads the rows once, wherever they are
    assert sorted(_ids(_parquet_files(out))) == want
    if importlib.util.find_spec("duckdb") is not None:
        import duckdb

        for pattern, rows in (("*.parquet", glob_ids), ("**/*.parquet", ids)):
            if rows:  # DuckDB refuses a glob that matches no file
                q = f"SELECT id FROM '{out}/{pattern}'"
                assert sorted(r[0] for r in duckdb.sql(q).fetchall()) == sorted(rows), pattern


def _parquet_files(out) -> list[str]:
    """Every file under out named *.parquet, hidden ones included (as DuckDB's globs see)."""
    found = []
    for folder, _, names in os.walk(out):
        found += [os.path.join(folder, n) for n in names if n.endswith(".parquet")]
    return found


def _ids(files) -> list:
    return [i for f in files for i in pq.read_table(f).column("id").to_pylist()]


@pytest.fixture
def source(tmp_path):
    return write_parquet(
        tmp_path / "in.parquet", {"prompt": [f"the quick fox {i}" for i in range(N)]}
    )


def test_run_then_report_stays_a_dataset(tmp_path, model, source):
    out = tmp_path / "out"
    run_job(source, out, model, *FLAGS)
    assert (out / SUCCESS_FILE).exists() and (out / STATS_FILE).exists()
    r = run_cli("report", out)
    assert (out / REPORT_FILE).exists() and str(out / REPORT_FILE) in r.stdout
    assert_dataset(out, list(range(N)), tmp_path)


def test_openai_output_stays_a_dataset(tmp_path, model):
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "any", "prompt": f"the lazy dog {i}", "max_tokens": 2},
        }
        for i in range(N)
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    run_job(src, out, model, "--output-format", "openai")
    results = (out / RESULTS_FILE).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in results] == [f"r{i}" for i in range(N)]
    want = sorted(f"r{i}" for i in range(N))
    for read in (pd.read_parquet(out), ds.dataset(out).to_table().to_pandas()):
        assert sorted(read["custom_id"]) == want
    datasets = pytest.importorskip("datasets")
    d = datasets.load_dataset("parquet", data_dir=str(out), cache_dir=str(tmp_path / "c"))
    assert sorted(d["train"]["custom_id"]) == want


def test_merged_shards_read_once(tmp_path, model, source):
    out = tmp_path / "out"
    for i in range(2):
        run_job(source, out, model, *FLAGS, "--shard", f"{i}/2")
    run_cli("merge", out)
    run_cli("report", out)
    assert len(pq.read_table(out / MERGED_FILE)) == N
    # The rows are in the shard folders: directory readers read them there, once; the
    # top-level glob finds none (read a sharded output with OUT/shard-*/*.parquet).
    assert_dataset(out, list(range(N)), tmp_path, glob_ids=[])
    files = glob.glob(os.path.join(out, "shard-*", "*.parquet"))
    assert sorted(i for f in files for i in pq.read_table(f).column("id").to_pylist()) == list(
        range(N)
    )


def test_older_layout_is_moved_on_resume_and_report(tmp_path, model, source):
    """An output of batchgen 0.1 (bookkeeping at the top, `_`-named) is moved into .batchgen/
    when run again, and reads as a dataset afterwards."""
    out = tmp_path / "out"
    run_job(source, out, model, *FLAGS)
    old = {JOB_FILE: "_job.json", STATS_FILE: "_stats.json", SUCCESS_FILE: "_SUCCESS"}
    for new, name in old.items():
        os.replace(out / new, out / name)
    os.replace(out / LOCK_PATH, out / LOCK_FILE)
    os.replace(out / STEPS_DIR / steps_part_name(0), out / "_steps.parquet")  # one flush
    os.rmdir(out / STEPS_DIR)
    os.remove(out / VERDICT_FILE)  # newer than that layout
    os.rmdir(out / META_DIR)
    r = run_job(source, out, model, *FLAGS)  # the same job: complete, nothing to redo
    assert "moving _job.json" in r.stderr or (out / JOB_FILE).exists()
    assert sorted(os.listdir(out)) == sorted([META_DIR, "part-00000.parquet"])
    assert (out / STEPS_FILE).exists()
    assert (out / SUCCESS_FILE).exists() and json.loads((out / JOB_FILE).read_text())
    assert_dataset(out, list(range(N)), tmp_path)


def test_an_earlier_outputs_hidden_parquet_files_are_renamed(tmp_path, model, source):
    """A merged output of the layout before: .steps.parquet at the top, merged.parquet and
    the shards' step parts as part-N.parquet under .batchgen/, each read as rows by DuckDB's
    OUT/*.parquet and OUT/**/*.parquet. A merge (and a rerun of a shard) renames them."""
    out = tmp_path / "out"
    for i in range(2):
        run_job(source, out, model, *FLAGS, "--shard", f"{i}/2")
    run_cli("merge", out)
    os.replace(out / STEPS_FILE, out / ".steps.parquet")
    os.replace(out / MERGED_FILE, out / META_DIR / "merged.parquet")
    shard = out / "shard-00000-of-00002"
    os.replace(shard / STEPS_DIR / steps_part_name(0), shard / STEPS_DIR / "part-00000.parquet")
    run_cli("merge", out)
    assert_dataset(out, list(range(N)), tmp_path, glob_ids=[])
    assert len(pq.read_table(out / MERGED_FILE)) == N and (out / STEPS_FILE).exists()
