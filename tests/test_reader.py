import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.data import InputFormat, default_ids, open_input
from batchgen.errors import InputError


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"p{i}", "x": i} for i in range(start, start + n)]


def _write_parquet(path, rows, **kw) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path, **kw)


def _write_jsonl(path, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _read_all(source, batch_rows: int = 3, columns=None):
    """(rows, offsets) with each batch's offset checked against the rows before it."""
    rows, offsets = [], []
    for offset, batch in source.iter_batches(batch_rows, columns):
        assert offset == len(rows)
        assert 0 < batch.num_rows <= batch_rows
        offsets.append(offset)
        rows.extend(batch.to_pylist())
    return rows, offsets


def _check_round_trip(source, rows) -> None:
    got, offsets = _read_all(source, batch_rows=3)
    assert got == rows
    assert offsets == list(range(0, len(rows), 3))  # exact batch sizes, only the last short


def test_parquet_file_round_trips(tmp_path):
    rows = _rows(10)
    _write_parquet(tmp_path / "in.parquet", rows)
    source = open_input(str(tmp_path / "in.parquet"))
    assert source.format is InputFormat.PARQUET
    assert source.columns == ["prompt", "x"]
    assert source.num_rows == 10
    _check_round_trip(source, rows)


def test_jsonl_file_round_trips(tmp_path):
    rows = _rows(10)
    _write_jsonl(tmp_path / "in.jsonl", rows)
    source = open_input(tmp_path / "in.jsonl")
    assert source.format is InputFormat.JSONL
    assert source.columns == ["prompt", "x"]
    assert source.num_rows is None
    _check_round_trip(source, rows)


def test_json_suffix_is_json_lines(tmp_path):
    rows = _rows(4)
    _write_jsonl(tmp_path / "in.json", rows)
    got, _ = _read_all(open_input(tmp_path / "in.json"))
    assert got == rows


def test_json_array_is_refused_with_a_fix(tmp_path):
    (tmp_path / "in.json").write_text(json.dumps(_rows(3)))
    with pytest.raises(InputError, match="JSON Lines"):
        open_input(tmp_path / "in.json")


def test_datasets_dir_round_trips(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows(10)
    # select() gives an indices mapping; save_to_disk must flatten it for order to hold.
    ds = datasets.Dataset.from_list(rows + _rows(5, start=100)).select(range(10))
    ds.save_to_disk(str(tmp_path / "ds"))
    source = open_input(tmp_path / "ds")
    assert source.format is InputFormat.DATASETS
    assert source.columns == ["prompt", "x"]
    assert source.num_rows == 10
    _check_round_trip(source, rows)
    assert not source.schema.metadata  # datasets' own metadata is not passed on


def test_datasets_dict_asks_for_a_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(3))})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match="train"):
        open_input(tmp_path / "dd")


def test_directory_and_glob_read_files_in_sorted_order(tmp_path):
    # Written out of order: b, a, c; read back a, b, c.
    for name, start in [("b", 100), ("a", 0), ("c", 200)]:
        _write_parquet(tmp_path / f"{name}.parquet", _rows(4, start))
    (tmp_path / "_SUCCESS").write_text("")  # bookkeeping files are not data
    expected = _rows(4, 0) + _rows(4, 100) + _rows(4, 200)
    for path in [tmp_path, tmp_path / "*.parquet"]:
        source = open_input(str(path))
        assert source.files == [str(tmp_path / f"{n}.parquet") for n in "abc"]
        assert source.num_rows == 12
        got, offsets = _read_all(source, batch_rows=5)
        assert got == expected
        assert offsets == [0, 5, 10]  # batches span file boundaries


def test_jsonl_glob_unifies_types_across_files(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p0", "note": None}])
    _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p1", "note": "hi"}])
    (tmp_path / "c.jsonl").write_text("\n")  # blank files are skipped
    source = open_input(str(tmp_path / "*.jsonl"))
    assert source.schema.field("note").type == pa.string()
    got, offsets = _read_all(source, batch_rows=1)
    assert got == [{"prompt": "p0", "note": None}, {"prompt": "p1", "note": "hi"}]
    assert offsets == [0, 1]


def test_missing_column_lists_available_columns(tmp_path):
    _write_parquet(tmp_path / "in.parquet", _rows(2))
    source = open_input(tmp_path / "in.parquet")
    source.require_columns(["prompt"])
    with pytest.raises(InputError) as e:
        source.require_columns(["prompt", "text", "label"])
    msg = str(e.value)
    assert "'text'" in msg and "'label'" in msg
    assert "available columns: 'prompt', 'x'" in msg


def test_column_projection(tmp_path):
    _write_parquet(tmp_path / "in.parquet", _rows(5))
    source = open_input(tmp_path / "in.parquet")
    got, _ = _read_all(source, columns=["x"])
    assert got == [{"x": i} for i in range(5)]
    with pytest.raises(InputError, match="available columns"):
        next(source.iter_batches(2, columns=["nope"]))


def test_corrupt_parquet_names_the_file(tmp_path):
    _write_parquet(tmp_path / "a.parquet", _rows(3))
    bad = tmp_path / "b.parquet"
    bad.write_bytes(b"this is not parquet" * 10)
    with pytest.raises(InputError, match="b.parquet"):
        open_input(tmp_path)


def test_truncated_parquet_names_the_file(tmp_path):
    good = tmp_path / "good.parquet"
    _write_parquet(good, _rows(100))
    data = good.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.parquet"):
        open_input(tmp_path / "cut.parquet")


def test_parquet_files_with_different_schemas_are_refused(tmp_path):
    _write_parquet(tmp_path / "a.parquet", _rows(2))
    _write_parquet(tmp_path / "b.parquet", [{"prompt": "p", "y": 1.5}])
    with pytest.raises(InputError, match="b.parquet"):
        open_input(tmp_path)


@pytest.mark.parametrize(
    "name, match",
    [
        ("missing.parquet", "does not exist"),
        ("nomatch-*.parquet", "no files match"),
        ("in.csv", "unsupported input format"),
    ],
)
def test_bad_paths_are_refused_with_a_fix(tmp_path, name, match):
    (tmp_path / "in.csv").write_text("prompt\nhi\n")
    with pytest.raises(InputError, match=match):
        open_input(tmp_path / name)


def test_directory_without_data_files_is_refused(tmp_path):
    (tmp_path / "sub").mkdir()
    _write_parquet(tmp_path / "sub" / "a.parquet", _rows(1))
    with pytest.raises(InputError, match=r"\*\*"):  # suggests a recursive glob
        open_input(tmp_path)
    source = open_input(str(tmp_path / "**" / "*.parquet"))
    assert source.num_rows == 1


def test_large_parquet_small_batches_every_row_once(tmp_path):
    n = 50_000
    table = pa.table({"x": pa.array(range(n), pa.int64())})
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=7_000)  # 8 row groups, last one short
    assert pq.ParquetFile(path).metadata.num_row_groups == 8
    source = open_input(path)
    assert source.num_rows == n

    seen = []
    for offset, batch in source.iter_batches(batch_rows=999):
        xs = batch.column("x").to_pylist()
        assert xs == list(range(offset, offset + batch.num_rows))  # offset is the row index
        seen.extend(xs)
    assert seen == list(range(n))


def test_jsonl_streams_in_blocks(tmp_path, monkeypatch):
    # Tiny blocks force many pyarrow blocks; rows, order and offsets must not depend on them.
    import batchgen.data.jsonl as jsonl

    monkeypatch.setattr(jsonl, "JSON_BLOCK_BYTES", 256)
    rows = _rows(500)
    _write_jsonl(tmp_path / "in.jsonl", rows)
    got, offsets = _read_all(open_input(tmp_path / "in.jsonl"), batch_rows=64)
    assert got == rows
    assert offsets == list(range(0, 500, 64))


def test_jsonl_type_change_mid_file_is_that_lines_error(tmp_path, monkeypatch):
    import batchgen.data.jsonl as jsonl

    monkeypatch.setattr(jsonl, "JSON_BLOCK_BYTES", 64)
    lines = [{"prompt": f"p{i}", "x": i} for i in range(20)] + [{"prompt": "p", "x": "str"}]
    lines.append({"prompt": "last", "x": 21})
    _write_jsonl(tmp_path / "in.jsonl", lines)
    source = open_input(tmp_path / "in.jsonl")
    error = source.error_column
    rows = [r for _, b in source.iter_batches(8, ["prompt", "x", error]) for r in b.to_pylist()]
    assert [r["x"] for r in rows] == [*range(20), None, 21]  # every line a row, in order
    assert [i for i, r in enumerate(rows) if r[error]] == [20]
    assert "in.jsonl line 21" in rows[20][error] and "changed from number" in rows[20][error]


def test_batches_share_one_schema_without_metadata(tmp_path):
    # pandas-style metadata differs per file; batches must still concatenate.
    for i, name in enumerate("ab"):
        t = pa.Table.from_pylist(_rows(2, 2 * i)).replace_schema_metadata({"k": name})
        pq.write_table(t, tmp_path / f"{name}.parquet")
    source = open_input(tmp_path)
    batches = [b for _, b in source.iter_batches(3)]
    assert all(b.schema.equals(source.schema, check_metadata=True) for b in batches)
    assert pa.Table.from_batches(batches).num_rows == 4


def test_default_ids_are_global_row_indices():
    assert default_ids(10, 3).to_pylist() == [10, 11, 12]
    assert default_ids(0, 0).to_pylist() == []


def test_bad_batch_arguments(tmp_path):
    _write_parquet(tmp_path / "in.parquet", _rows(2))
    source = open_input(tmp_path / "in.parquet")
    with pytest.raises(ValueError):
        next(source.iter_batches(0))


def test_expands_user_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write_parquet(tmp_path / "in.parquet", _rows(2))
    assert open_input(os.path.join("~", "in.parquet")).num_rows == 2
