import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import listing, read_output

from batchgen.data import OutputDir, PartBuffer, output_schema
from batchgen.data.layout import JOB_FILE, LOCK_PATH, STATS_FILE, SUCCESS_FILE
from batchgen.errors import InputError, OutputError

JOB = {"input": "in.parquet", "model": "tiny", "options": {"max_new_tokens": 8, "stop": ["\n"]}}
PASSTHROUGH = pa.schema([("label", pa.string())])


def _result(i: int, error: str | None = None, **extra) -> dict:
    """A result row of output_schema(int64, PASSTHROUGH)."""
    ok = error is None
    return {
        "id": i,
        "label": None if i % 2 else f"l{i}",
        "generated_text": f"out{i}" if ok else None,
        "finish_reason": "stop" if ok else "error",
        "prompt_tokens": 3 if ok else None,
        "completion_tokens": 5 if ok else None,
        "error": error,
        **extra,
    }


def _buffer(out: OutputDir, rows_per_part: int = 4, token_ids: bool = False) -> PartBuffer:
    return PartBuffer(out, rows_per_part, output_schema(pa.int64(), PASSTHROUGH, token_ids))


def test_output_schema_fields():
    schema = output_schema(pa.string(), PASSTHROUGH, with_token_ids=True)
    assert schema.names == [
        "id",
        "label",
        "generated_text",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "error",
        "token_ids",
    ]
    assert schema.field("id").type == pa.string()
    assert schema.field("prompt_tokens").type == pa.int32()
    assert schema.field("token_ids").type == pa.list_(pa.int32())
    assert "token_ids" not in output_schema(pa.int64(), PASSTHROUGH).names


def test_output_schema_refuses_clashing_passthrough():
    with pytest.raises(InputError, match="'generated_text'"):
        output_schema(pa.int64(), pa.schema([("generated_text", pa.string())]))


def test_output_schema_keeps_the_id_columns_name():
    other_id = pa.schema([("id", pa.string())])  # an input `id` that is not the id column
    schema = output_schema(pa.string(), other_id, id_column="row_id")
    assert schema.names[:2] == ["row_id", "id"] and schema.field("row_id").type == pa.string()
    with pytest.raises(InputError, match="'row_id'"):  # the id column cannot pass through
        output_schema(pa.int64(), pa.schema([("row_id", pa.int64())]), id_column="row_id")
    with pytest.raises(InputError, match="id column 'error'"):
        output_schema(pa.int64(), PASSTHROUGH, id_column="error")


def test_done_ids_of_a_named_id_column(tmp_path):
    out = OutputDir(tmp_path / "out", JOB)
    schema = output_schema(pa.string(), PASSTHROUGH, samples=True, id_column="key")
    rows = [{**_result(i), "key": f"k{i}", "sample_index": 1} for i in range(3)]
    for r in rows:
        del r["id"]
    PartBuffer(out, 2, schema).add(rows)
    assert out.done_ids("key") == {("k0", 1), ("k1", 1)}
    with pytest.raises(InputError, match="no id column 'id'.*--overwrite"):
        out.done_ids()


def test_parts_and_done_ids(tmp_path):
    out = OutputDir(tmp_path / "out", JOB)
    buf = _buffer(out, rows_per_part=4)
    buf.add([_result(i) for i in range(3)])
    assert out.part_files() == []  # 3 rows buffered, under a part
    buf.add([_result(i) for i in range(3, 10)])  # crosses two part boundaries
    assert out.part_files() == ["part-00000.parquet", "part-00001.parquet"]
    assert read_output(tmp_path / "out").num_rows == 8  # 2 still buffered
    buf.flush()
    assert out.part_files() == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert out.done_ids() == set(range(10))
    table = read_output(tmp_path / "out")
    assert table.column("id").to_pylist() == list(range(10))
    assert table.column("generated_text").to_pylist() == [f"out{i}" for i in range(10)]
    assert not out.is_complete
    out.mark_success()
    assert out.is_complete


def test_resume_continues_numbering_and_keeps_done_ids(tmp_path):
    out = OutputDir(tmp_path, JOB)
    _buffer(out, 2).add([_result(i) for i in range(4)])
    out.close()
    # A rerun of the same job (fingerprint equal up to tuple/list and key order).
    same = {
        "options": {"stop": ("\n",), "max_new_tokens": 8},
        "model": "tiny",
        "input": "in.parquet",
    }
    out2 = OutputDir(tmp_path, same)
    assert out2.done_ids() == {0, 1, 2, 3}
    buf = _buffer(out2, 2)
    buf.add([_result(i) for i in range(4, 6)])
    assert out2.part_files()[-1] == "part-00002.parquet"
    assert out2.done_ids() == set(range(6))


def test_nulls_and_schema_are_consistent_across_parts(tmp_path):
    out = OutputDir(tmp_path, JOB)
    buf = _buffer(out, rows_per_part=2, token_ids=True)
    # Part 0 is all errors (every generation column null), part 1 all successes.
    buf.add([_result(0, "bad", token_ids=None), _result(1, "bad", token_ids=None)])
    buf.add([_result(2, token_ids=[1, 2]), _result(3, token_ids=[])])
    schemas = [pq.read_schema(tmp_path / n) for n in out.part_files()]
    assert len(schemas) == 2
    assert schemas[0].equals(schemas[1])
    assert schemas[0].field("prompt_tokens").type == pa.int32()
    assert (
        schemas[0].field("generated_text").type == pa.string()
    )  # not null-typed in the all-null part
    table = read_output(tmp_path)
    assert table.column("error").to_pylist() == ["bad", "bad", None, None]
    assert table.column("token_ids").to_pylist() == [None, None, [1, 2], []]
    assert table.column("label").to_pylist() == ["l0", None, "l2", None]


def test_rows_must_match_the_schema(tmp_path):
    out = OutputDir(tmp_path, JOB)
    buf = _buffer(out)
    row = _result(0)
    del row["error"]
    with pytest.raises(ValueError, match="missing \\['error'\\]"):
        buf.add([row])
    with pytest.raises(ValueError, match="unexpected \\['token_ids'\\]"):
        buf.add([_result(0, token_ids=[1])])
    buf.flush()
    assert out.part_files() == []  # neither refused row was kept


def test_stray_temp_file_is_removed_and_never_counted(tmp_path, caplog):
    out = OutputDir(tmp_path, JOB)
    _buffer(out, 2).add([_result(0), _result(1)])
    # A run killed mid-write leaves a half-written temp part behind.
    stray = tmp_path / ".tmp-part-00001.parquet.abc123"
    pq.write_table(pa.Table.from_pylist([_result(7)]), stray)
    out.close()
    with caplog.at_level(logging.WARNING):
        out2 = OutputDir(tmp_path, JOB)
    assert not stray.exists()
    assert "temp file" in caplog.text
    assert out2.done_ids() == {0, 1}
    assert out2.part_files() == ["part-00000.parquet"]


def test_write_part_leaves_no_temp_files(tmp_path):
    out = OutputDir(tmp_path, JOB)
    name = out.write_part(pa.table({"id": [1, 2]}))
    out.write_stats({"rows": 2})
    out.mark_success()
    assert name == "part-00000.parquet"
    assert listing(tmp_path) == sorted(
        [SUCCESS_FILE, JOB_FILE, LOCK_PATH, STATS_FILE, "part-00000.parquet"]
    )
    assert json.loads((tmp_path / STATS_FILE).read_text()) == {"rows": 2}


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    out = OutputDir(tmp_path, JOB)

    def disk_full(table, f):
        f.write(b"PAR1 half a part")
        raise OSError("No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(OutputError, match="No space"):
        out.write_part(pa.table({"id": [1]}))
    assert listing(tmp_path) == sorted([JOB_FILE, LOCK_PATH])
    monkeypatch.undo()
    assert out.write_part(pa.table({"id": [1]})) == "part-00000.parquet"  # same number reused


def test_corrupt_part_is_deleted_and_its_rows_redone(tmp_path, caplog):
    out = OutputDir(tmp_path, JOB)
    _buffer(out, 2).add([_result(i) for i in range(4)])
    (tmp_path / "part-00001.parquet").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        assert out.done_ids() == {0, 1}
    assert "part-00001.parquet" in caplog.text
    assert out.part_files() == ["part-00000.parquet"]


def test_refuses_another_jobs_output(tmp_path):
    out = OutputDir(tmp_path, JOB)
    _buffer(out, 1).add([_result(0)])
    out.close()
    with pytest.raises(InputError) as e:
        OutputDir(tmp_path, {**JOB, "model": "other"})
    assert "another job" in str(e.value) and "--overwrite" in str(e.value)
    assert "differs in model" in str(e.value)
    with OutputDir(tmp_path, JOB) as out:
        assert out.done_ids() == {0}  # untouched


def test_overwrite_clears_only_our_files(tmp_path):
    out = OutputDir(tmp_path, JOB)
    _buffer(out, 1).add([_result(0), _result(1)])
    out.write_stats({"rows": 2})
    out.mark_success()
    (tmp_path / "notes.txt").write_text("mine")
    out.close()
    other = {**JOB, "model": "other"}
    with OutputDir(tmp_path, other, overwrite=True) as out2:
        assert listing(tmp_path) == sorted([JOB_FILE, LOCK_PATH, "notes.txt"])
        assert out2.done_ids() == set() and not out2.is_complete
    assert json.loads((tmp_path / JOB_FILE).read_text()) == other
    with OutputDir(tmp_path, other) as out3:
        assert out3.done_ids() == set()  # now it is the other job's dir


def test_overwrite_same_job_starts_fresh(tmp_path):
    with OutputDir(tmp_path, JOB) as out:
        _buffer(out, 1).add([_result(0)])
    with OutputDir(tmp_path, JOB, overwrite=True) as out:
        assert out.done_ids() == set()


def test_refuses_a_foreign_directory_even_with_overwrite(tmp_path):
    (tmp_path / "data.parquet").write_bytes(b"someone else's")
    for overwrite in (False, True):
        with pytest.raises(InputError, match="not written by batchgen.*data.parquet"):
            OutputDir(tmp_path, JOB, overwrite=overwrite)
    assert (tmp_path / "data.parquet").read_bytes() == b"someone else's"
    assert os.listdir(tmp_path) == ["data.parquet"]  # not even the lock or JOB_FILE


def test_parts_without_job_file_need_overwrite(tmp_path):
    pq.write_table(pa.table({"id": [1]}), tmp_path / "part-00000.parquet")
    with pytest.raises(InputError, match="--overwrite"):
        OutputDir(tmp_path, JOB)
    assert OutputDir(tmp_path, JOB, overwrite=True).part_files() == []


def test_unreadable_job_file_is_treated_as_another_job(tmp_path):
    (tmp_path / JOB_FILE).parent.mkdir()
    (tmp_path / JOB_FILE).write_text("{not json")
    pq.write_table(pa.table({"id": [1]}), tmp_path / "part-00000.parquet")
    with pytest.raises(InputError, match="another job"):
        OutputDir(tmp_path, JOB)


def test_output_path_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(InputError, match="is a file"):
        OutputDir(tmp_path / "f", JOB)


def test_empty_output(tmp_path):
    out = OutputDir(tmp_path / "new" / "dir", JOB)
    assert out.done_ids() == set()
    assert out.part_files() == []
