"""One bad cell is a per-row error, one bad column or model an exit 2 before the model loads:
never a traceback (issue 22, defects 3 and 8)."""

import json
import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    assert_one_line_error,
    prompts,
    rows_by_id,
    run_job,
    write_jsonl,
    write_parquet,
)
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def broken_weights(model, tmp_path_factory):
    """The tiny Llama with unreadable weights: an error that comes first proves the check ran
    before the model loaded."""
    d = tmp_path_factory.mktemp("broken") / "m"
    shutil.copytree(model, d)
    (d / "model.safetensors").write_bytes(b"not safetensors")
    return d


def test_infinite_or_fractional_row_values_are_row_errors(tmp_path, model):
    inf = math.inf
    cols = {
        "prompt": prompts(6),
        "max_new_tokens": [4.0, inf, 3.0, 2.7, 4.0, 4.0],
        "seed": [1.0, 2.0, inf, 3.0, 4.0, 5.0],
        "temperature": [0.5, 0.5, 0.5, 0.5, math.nan, inf],
    }
    src = write_parquet(tmp_path / "in.parquet", cols)
    run_job(src, tmp_path / "out", model)
    rows = rows_by_id(tmp_path / "out")
    assert rows[0]["error"] is None and rows[0]["finish_reason"] in ("stop", "length")
    for i, words in [
        (1, ["max_new_tokens", "inf"]),
        (2, ["seed", "inf"]),
        (3, ["max_new_tokens", "2.7", "not an integer"]),
        (4, ["temperature", "nan"]),
        (5, ["temperature", "inf"]),
    ]:
        assert rows[i]["finish_reason"] == "error", rows[i]
        for w in words:
            assert w in rows[i]["error"], (w, rows[i]["error"])


def test_infinite_n_is_a_row_error(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2), "n": [2.0, math.inf]})
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 2)
    rows = pq.read_table(next((tmp_path / "out").glob("part-*.parquet"))).to_pylist()
    bad = [r for r in rows if r["id"] == 1]
    assert len(bad) == 1 and "n" in bad[0]["error"] and "inf" in bad[0]["error"]
    assert sorted(r["sample_index"] for r in rows if r["id"] == 0) == [0, 1]


@pytest.mark.parametrize(
    "ids",
    [
        pa.array([[1], [2]], pa.list_(pa.int64())),
        pa.array([{"a": 1}, {"a": 2}]),
        pa.array([True, False]),
    ],
    ids=["list", "struct", "bool"],
)
def test_id_column_of_a_nested_type_exits_2_before_load(tmp_path, broken_weights, ids):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": prompts(2), "key": ids}), src)
    r = run_job(src, tmp_path / "out", broken_weights, "--id-column", "key", exit_code=2)
    assert_one_line_error(r, "'key'", "integers or strings")


def test_duplicate_column_names_exit_2(tmp_path, broken_weights):
    table = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["c", "d"])], ["prompt"] * 2)
    pq.write_table(table, tmp_path / "in.parquet")
    r = run_job(tmp_path / "in.parquet", tmp_path / "out", broken_weights, exit_code=2)
    assert_one_line_error(r, "duplicate", "'prompt'")


def test_tokenizer_larger_than_the_vocabulary_exits_2(tmp_path, model):
    small = tmp_path / "m"
    shutil.copytree(model, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 256
    (small / "config.json").write_text(json.dumps(config))
    tokens = len(AutoTokenizer.from_pretrained(small))
    assert tokens > 256
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_job(src, tmp_path / "out", small, exit_code=2)
    assert_one_line_error(r, f"tokenizer has {tokens} tokens", "vocab_size) 256")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_repeated_id_in_a_later_window_exits_2_before_load(tmp_path, broken_weights, fmt):
    ids = [f"r{i}" for i in range(40)] + ["r3"]
    rows = {"prompt": prompts(41), "key": ids}
    src = tmp_path / f"in.{fmt}"
    if fmt == "parquet":
        write_parquet(src, rows)
    else:
        write_jsonl(src, [{"prompt": p, "key": k} for p, k in zip(*rows.values(), strict=True)])
    out = tmp_path / "out"
    r = run_job(src, out, broken_weights, "--id-column", "key", "--window-rows", 8, exit_code=2)
    assert_one_line_error(r, "'key'", "'r3' twice")
    assert not list(out.glob("part-*"))
    # under --limit, only the rows the job reads count; a null id is refused too
    r = run_job(src, out, broken_weights, "--id-column", "key", "--limit", 40, exit_code=2)
    assert_one_line_error(r, "weights")  # past the id check: the broken weights fail the load
    write_parquet(tmp_path / "null.parquet", {"prompt": prompts(3), "key": ["a", None, "b"]})
    r = run_job(
        tmp_path / "null.parquet",
        tmp_path / "o2",
        broken_weights,
        "--id-column",
        "key",
        exit_code=2,
    )
    assert_one_line_error(r, "null", "input row 1")
