"""`batchgen merge`: refuses missing, unfinished or foreign shards; merges complete ones."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import BASE_COLUMNS, prompts, read_stats, run_cli, run_job, success, write_parquet

from batchgen.cli import main
from batchgen.data import OutputDir, PartBuffer, output_schema
from batchgen.data.layout import JOB_FILE, MERGED_FILE, META_DIR
from batchgen.errors import MergeError
from batchgen.job.shard import Shard, shard_of
from batchgen.scaleout.merge import IncompleteOutput, merge

SCHEMA = output_schema(pa.int64(), pa.schema([("label", pa.string())]))


def _job(**kw) -> dict:
    return {"input": "in.parquet", "output": "out", "max_new_tokens": 4, **kw}


def write_shard(out, shard: Shard, ids, *, complete=True, wall_s=2.0, job=None, stats=True):
    """A shard directory as `batchgen run --shard` leaves it, without running a model."""
    d = OutputDir(out / shard.dirname, _job(shard=str(shard), **(job or {})))
    buf = PartBuffer(d, rows_per_part=3, schema=SCHEMA)
    buf.add(
        {
            "id": i,
            "label": "x",
            "generated_text": f"t{i}",
            "finish_reason": "stop",
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "error": "bad row" if i == 0 else None,
        }
        for i in ids
    )
    buf.flush()
    if stats:
        d.write_stats(
            {"wall_s": wall_s, "complete": complete, "device": "cpu", "rows_skipped_done": 0}
        )
    if complete:
        d.mark_success()
    return d


def split(ids, n):
    return {i: [x for x in ids if shard_of(x, n) == i] for i in range(n)}


def test_merge_complete_shards(tmp_path):
    ids = list(range(20))
    for i, part in split(ids, 3).items():
        write_shard(tmp_path, Shard(i, 3), part, wall_s=1.0 + i)
    summary = merge(tmp_path)
    table = pq.read_table(tmp_path / MERGED_FILE)
    assert sorted(table.column("id").to_pylist()) == ids
    assert table.schema.equals(SCHEMA)
    stats = read_stats(tmp_path)
    assert stats["rows"] == 20 and stats["rows_error"] == 1 and stats["shards"] == 3
    assert stats["output_tokens"] == 40 and stats["max_wall_s"] == 3.0
    assert stats["output_tokens_per_s"] == pytest.approx(40 / 3.0)
    assert [s["rows"] for s in stats["per_shard"]] == [len(p) for p in split(ids, 3).values()]
    assert success(tmp_path)
    table_text = summary.table()
    assert "0/3" in table_text and "2/3" in table_text and "total" in table_text


def test_cli_merge_prints_table_and_stats_only(tmp_path):
    for i, part in split(list(range(8)), 2).items():
        write_shard(tmp_path, Shard(i, 2), part)
    r = CliRunner().invoke(main, ["merge", str(tmp_path), "--stats-only"])
    assert r.exit_code == 0, r.output
    assert "total" in r.output and "1/2" in r.output
    assert not (tmp_path / MERGED_FILE).exists()
    assert read_stats(tmp_path)["rows"] == 8


def test_refuses_missing_and_unfinished_shards_by_number(tmp_path):
    parts = split(list(range(40)), 5)
    write_shard(tmp_path, Shard(0, 5), parts[0])
    write_shard(tmp_path, Shard(1, 5), parts[1][:2], complete=False)  # stopped by a signal
    write_shard(tmp_path, Shard(2, 5), parts[2][:2], complete=False, stats=False)  # killed
    write_shard(tmp_path, Shard(4, 5), parts[4])  # shard 3 never started
    with pytest.raises(IncompleteOutput) as e:
        merge(tmp_path)
    assert e.value.todo == [1, 2, 3]
    msg = str(e.value)
    assert "shard 1/5: its last run stopped early" in msg
    assert "shard 2/5: incomplete" in msg
    assert "shard 3/5: missing" in msg
    assert not (tmp_path / MERGED_FILE).exists() and not success(tmp_path)
    r = CliRunner().invoke(main, ["merge", str(tmp_path)])
    assert r.exit_code == 1 and "shards to (re)run: 1,2,3" in r.output


def test_refuses_shards_of_different_jobs(tmp_path):
    write_shard(tmp_path, Shard(0, 2), [1, 2])
    write_shard(tmp_path, Shard(1, 2), [3], job={"max_new_tokens": 8})
    with pytest.raises(
        IncompleteOutput, match=r"shard 1/2: a different job.*max_new_tokens: 4 vs 8"
    ):
        merge(tmp_path)


def test_refuses_mixed_splits_and_empty_directories(tmp_path):
    with pytest.raises(MergeError, match="no shard-IIIII-of-NNNNN"):
        merge(tmp_path)
    write_shard(tmp_path, Shard(0, 2), [1])
    write_shard(tmp_path, Shard(0, 3), [1])
    with pytest.raises(MergeError, match="2 different splits"):
        merge(tmp_path)


def test_row_count_checked_against_the_input(tmp_path):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"] * 10}), data)
    out = tmp_path / "out"
    parts = split(list(range(9)), 2)  # one row short of the input's 10
    for i in range(2):
        write_shard(out, Shard(i, 2), parts[i], job={"input": str(data)})
    with pytest.raises(MergeError, match="hold 9 rows but the input"):
        merge(out)
    for i in range(2):
        (out / Shard(i, 2).dirname / JOB_FILE).write_text(
            json.dumps(_job(shard=f"{i}/2", input=str(data), limit=9))
        )
    assert merge(out).rows == 9  # with limit 9, nine rows are all of them


def test_cli_shards_with_an_id_column_merge_under_its_name(tmp_path, tiny_dirs):
    """`batchgen run --shard I/N --id-column key`, then `batchgen merge`: every key once, under
    `key`, and no `id` column."""
    keys = [f"k{(i * 7919) % 1000:03d}" for i in range(12)]
    src = write_parquet(tmp_path / "in.parquet", {"key": keys, "prompt": prompts(12)})
    out = tmp_path / "out"
    for i in range(2):
        run_job(
            src,
            out,
            tiny_dirs["llama"],
            "--max-new-tokens",
            2,
            "--id-column",
            "key",
            "--shard",
            f"{i}/2",
        )
    run_cli("merge", out)
    merged = pq.read_table(out / MERGED_FILE)
    assert merged.schema.names == ["key", "prompt", *BASE_COLUMNS]
    assert sorted(merged.column("key").to_pylist()) == sorted(keys)
    assert json.loads(merged.schema.metadata[b"batchgen"])["id_column"] == "key"


def test_shards_without_rows_merge_into_an_empty_file_of_the_id_column(tmp_path):
    for i in range(2):
        write_shard(tmp_path, Shard(i, 2), [], job={"id_column": "key"})
    assert merge(tmp_path).rows == 0
    assert pq.read_table(tmp_path / MERGED_FILE).schema.names == ["key"]


def test_a_merge_removes_the_temp_files_of_a_merge_killed_mid_write(tmp_path):
    for i, part in split(list(range(6)), 2).items():
        write_shard(tmp_path, Shard(i, 2), part)
    meta = tmp_path / META_DIR
    meta.mkdir()
    left = [meta / ".tmp-merged.parquet.k3j_9x", meta / ".tmp-stats.json.a1b2c3"]
    left.append(tmp_path / ".tmp-_stats.json.d4e5f6")  # a batchgen 0.1 merge's
    for f in left:
        f.write_bytes(b"half a file")
    other = tmp_path / ".tmp-notes.txt.abc"  # not a merge's: kept
    other.write_text("mine")
    merge(tmp_path)
    assert not any(f.exists() for f in left) and other.exists()
    assert pq.read_table(tmp_path / MERGED_FILE).num_rows == 6
