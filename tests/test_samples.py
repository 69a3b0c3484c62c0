"""n samples per row (--n, an n column): one output record per (id, sample_index), each with
its own seed, exactly once across reruns; the real CLI on a tiny random model."""

import json
import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    FAST,
    cli_command,
    prompts,
    read_output,
    read_stats,
    run_cli,
    run_job,
    success,
    write_parquet,
)

from batchgen.data.layout import MERGED_FILE, SUCCESS_FILE, VERDICT_FILE

SAMPLED = ("--temperature", 1.0, "--max-new-tokens", 6, "--ignore-eos", "--with-token-ids")


def _samples(out, id_column: str = "id") -> dict:
    rows = read_output(out).to_pylist()
    keys = [(r[id_column], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (id, sample_index) written twice"
    return dict(zip(keys, rows, strict=True))


def test_n_samples_are_distinct_and_sample_0_is_the_plain_row(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the same prompt"] * 2})
    run_job(src, tmp_path / "n3", model, *SAMPLED, "--n", 3)
    got = _samples(tmp_path / "n3")
    assert sorted(got) == [(i, k) for i in range(2) for k in range(3)]
    assert len({tuple(r["token_ids"]) for r in got.values()}) == 6  # all independent
    run_job(src, tmp_path / "n1", model, *SAMPLED)
    plain = {r["id"]: r for r in read_output(tmp_path / "n1").to_pylist()}
    assert "sample_index" not in read_output(tmp_path / "n1").column_names
    assert all(got[(i, 0)]["token_ids"] == plain[i]["token_ids"] for i in range(2))
    assert read_stats(tmp_path / "n3")["rows"] == 6


def test_n_column_overrides_per_row_and_a_bad_n_is_an_error_record(tmp_path, model):
    n = [None, 3, 0, 129]  # 129: over the 128 an OpenAI request may ask for
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4), "n": n})
    run_job(src, tmp_path / "out", model, *SAMPLED, "--n", 2)
    got = _samples(tmp_path / "out")
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0)]
    assert "bad per-row n" in got[(2, 0)]["error"]
    assert "not an integer in [1, 128]" in got[(3, 0)]["error"]


def test_n_over_128_is_refused_before_anything_loads(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(1)})
    r = run_cli("run", src, "-o", tmp_path / "out", "--model", model, "--n", 129, exit_code=2)
    assert "129" in r.output and "128" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("id_column", ["id", "key"], ids=["row-numbers", "id-column"])
def test_resume_completes_every_sample_exactly_once(tmp_path, model, id_column):
    keys = ["d", "b", "a", "c"]
    src = write_parquet(tmp_path / "in.parquet", {"key": keys, "prompt": prompts(4)})
    out = tmp_path / "out"
    args = (src, out, model, *SAMPLED, "--n", 3, "--rows-per-part", 2)
    if id_column != "id":
        args = (*args, "--id-column", id_column)
    run_job(*args)
    first = _samples(out, id_column)
    ids = keys if id_column != "id" else range(4)
    assert sorted(first) == sorted((i, k) for i in ids for k in range(3))
    names = read_output(out).schema.names
    assert names[:2] == [id_column, "sample_index"] and ("id" in names) == (id_column == "id")
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) >= 3
    for p in parts[1::2]:  # as if the job had been killed before these were written
        p.unlink()
    (out / SUCCESS_FILE).unlink()
    run_job(*args)
    again = _samples(out, id_column)
    assert sorted(again) == sorted(first)
    assert all(again[k]["token_ids"] == first[k]["token_ids"] for k in first)
    assert success(out)


def test_n_as_list_gives_one_row_with_the_samples_in_order(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3), "n": [2, None, 0]})
    run_job(src, tmp_path / "rows", model, *SAMPLED, "--n", 3)
    per_sample = _samples(tmp_path / "rows")
    out = tmp_path / "lists"
    as_lists = ("--n", 3, "--n-as-list", "--with-logprobs", "--rows-per-part", 1)
    run_job(src, out, model, *SAMPLED, *as_lists)
    table = read_output(out)
    assert "sample_index" not in table.column_names
    assert table.schema.field("generated_text").type.value_type == pa.string()
    got = {r["id"]: r for r in table.to_pylist()}
    assert sorted(got) == [0, 1, 2]  # one record per row
    for i, n in ((0, 2), (1, 3)):
        assert got[i]["token_ids"] == [per_sample[(i, k)]["token_ids"] for k in range(n)]
        assert got[i]["generated_text"] == [per_sample[(i, k)]["generated_text"] for k in range(n)]
        assert got[i]["finish_reason"] == ["length"] * n and got[i]["error"] is None
        assert [len(x) for x in got[i]["logprobs"]] == got[i]["completion_tokens"] == [6] * n
    assert got[2]["generated_text"] == [None] and "bad per-row n" in got[2]["error"]
    assert read_stats(out)["rows"] == 3  # records written, one a row
    # a rerun finds every row done; a killed part's rows are redone whole
    (out / SUCCESS_FILE).unlink()
    sorted(out.glob("part-*.parquet"))[0].unlink()
    run_job(src, out, model, *SAMPLED, *as_lists)
    again = {r["id"]: r for r in read_output(out).to_pylist()}
    assert again == got


@pytest.mark.parametrize("as_list", [True, False])
def test_rows_count_records_with_and_without_n_as_list(tmp_path, model, as_list):
    # --n 4 over 3 rows (one of them a bad n: one error record): with --n-as-list 3 records,
    # so 3 rows in stats.json, the printed line, the progress line and the verdict; else 9
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3), "n": [None, None, 0]})
    out = tmp_path / "out"
    flags = ("--n", 4, *(("--n-as-list",) if as_list else ()), "--max-error-rate", 1)
    cmd = cli_command("run", src, "-o", out, "--model", model, *FAST, *SAMPLED, *flags)
    env = {**os.environ, "BATCHGEN_PROGRESS_SECONDS": "1e-9"}  # every batch of finished rows
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    rows = 3 if as_list else 4 + 4 + 1
    assert read_output(out).num_rows == rows
    stats = read_stats(out)
    assert (stats["rows"], stats["rows_error"], sum(stats["error_reasons"].values())) == (
        rows,
        1,
        1,
    )
    assert p.stdout.startswith(f"wrote {out}: {rows} rows (1 error)"), p.stdout
    lines = [x for x in p.stderr.splitlines() if x.startswith("batchgen: ")]
    total = 3 if as_list else 12  # an n column's rows: approximate
    assert lines and lines[-1].startswith(f"batchgen: {rows}/{total} rows"), p.stderr
    verdict = json.loads((out / VERDICT_FILE).read_text())
    assert (verdict["rows"], verdict["error_rows"]) == (rows, 1)


def test_sample_lists_hold_a_row_until_its_last_sample():
    from batchgen.data.sample_lists import SampleLists

    lists = SampleLists()
    rec = lambda k, err=None: {"id": 7, "sample_index": k, "generated_text": f"t{k}", "error": err}  # noqa: E731
    assert lists.add(7, 3, 2, rec(2)) is None and lists.add(7, 3, 0, rec(0, "x")) is None
    assert lists.pending == 1
    assert lists.add(7, 3, 1, rec(1)) == {
        "id": 7,
        "generated_text": ["t0", "t1", "t2"],
        "error": "x",
    }
    assert lists.pending == 0


def test_n_as_list_shards_merge(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(5)})
    out = tmp_path / "out"
    for shard in ("0/2", "1/2"):
        run_job(src, out, model, *SAMPLED, "--n", 2, "--n-as-list", "--shard", shard)
    run_cli("merge", out)
    merged = pq.read_table(out / MERGED_FILE)
    assert sorted(merged.column("id").to_pylist()) == list(range(5))
    assert all(len(t) == 2 for t in merged.column("generated_text").to_pylist())
