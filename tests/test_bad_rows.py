"""Bad rows get an error record and the job goes on; a bad input fails before any model loads."""

import json
import shutil

import pytest
from helpers import read_output, rows_by_id, run_cli, run_job, success, write_jsonl, write_parquet

LONG = "the quick brown fox jumps over the lazy dog. " * 8  # well over 16 tokens


def _run(src, out, model, *flags, exit_code=0):
    return run_job(src, out, model, "--max-new-tokens", 4, *flags, exit_code=exit_code)


def _check_error_row(row, *words):
    assert row["finish_reason"] == "error"
    assert row["generated_text"] is None and row["completion_tokens"] == 0
    for w in words:
        assert w in row["error"], (w, row["error"])


def _check_ok_row(row):
    assert row["error"] is None
    assert row["finish_reason"] in ("stop", "length")
    assert isinstance(row["generated_text"], str) and row["completion_tokens"] >= 1
    assert row["prompt_tokens"] >= 1


BAD_ROWS = [  # (JSONL record, None for an ok row or words the error must contain)
    ({"prompt": "the quick brown fox"}, None),
    ({"prompt": None}, ["null"]),
    ({"other": "no prompt key at all"}, ["null"]),
    ({"prompt": ""}, ["empty"]),
    ({"prompt": "  \n "}, ["empty"]),
    ({"prompt": LONG}, ["max_prompt_len", "--truncate"]),
    ({"prompt": "summarise the text in one sentence."}, None),
]


def test_bad_rows_table(tmp_path, model):
    src = write_jsonl(tmp_path / "in.jsonl", [rec for rec, _ in BAD_ROWS])
    out = tmp_path / "out"
    _run(src, out, model, "--max-prompt-len", 16)
    rows = rows_by_id(out)
    assert sorted(rows) == list(range(len(BAD_ROWS)))
    for i, (_, words) in enumerate(BAD_ROWS):
        if words is None:
            _check_ok_row(rows[i])
        else:
            _check_error_row(rows[i], *words)
    assert success(out)


def test_non_string_values_are_row_errors(tmp_path, model):
    """A number where text belongs: a whole non-string prompt column, and a number as one
    chat message's content (messages stored as JSON strings)."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [1, 2], "k": [3, 4]})
    _run(src, tmp_path / "out", model)
    for row in rows_by_id(tmp_path / "out").values():
        _check_error_row(row, "int", "not a string")

    chats = [
        [{"role": "user", "content": "the quick brown fox"}],
        [{"role": "user", "content": 5}],
        {"role": "user", "content": "not a list"},
        [{"role": "user", "content": "great product"}],
    ]
    src = write_parquet(tmp_path / "chat.parquet", {"messages": [json.dumps(c) for c in chats]})
    _run(src, tmp_path / "chat", model, "--messages-column", "messages")
    rows = rows_by_id(tmp_path / "chat")
    _check_ok_row(rows[0])
    _check_error_row(rows[1], "content")
    _check_error_row(rows[2], "list")
    _check_ok_row(rows[3])


def test_template_that_fails_for_some_rows(tmp_path, model):
    recs = [
        {"title": "review", "body": "great product", "k": 1},
        {"title": "review", "body": None, "k": 1},  # null column
        {"title": "review", "k": 1},  # key missing from this line
        {"title": "review", "body": "the lazy dog", "k": 0},  # raises while rendering
        {"title": "review", "body": "the quick brown fox", "k": 2},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    _run(src, out, model, "-t", "{{ title }} ({{ 10 // k }}): {{ body }}")
    rows = rows_by_id(out)
    _check_ok_row(rows[0])
    _check_error_row(rows[1], "body")
    _check_error_row(rows[2], "body")
    _check_error_row(rows[3], "ZeroDivisionError")
    _check_ok_row(rows[4])
    assert read_output(out).schema.names[:4] == ["id", "title", "body", "k"]


def test_prompt_and_max_new_tokens_over_the_model_positions(tmp_path, model):
    """The tiny models have 256 positions: a 200-token prompt fits, but not with 100 new tokens."""
    long_ok = "the quick brown fox " * 40
    src = write_parquet(
        tmp_path / "in.parquet",
        {"prompt": [long_ok, long_ok, "the lazy dog"], "max_new_tokens": [100, 4, 100]},
    )
    _run(src, tmp_path / "out", model)
    rows = rows_by_id(tmp_path / "out")
    _check_error_row(rows[0], "positions")
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] > 150  # measured, then refused
    _check_ok_row(rows[1])
    _check_ok_row(rows[2])


@pytest.mark.parametrize("policy", ["left", "right"])
def test_truncate_keeps_part_of_a_long_prompt(tmp_path, model, policy):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [LONG, "the lazy dog"]})
    _run(src, tmp_path / "out", model, "--max-prompt-len", 16, "--truncate", policy)
    rows = rows_by_id(tmp_path / "out")
    _check_ok_row(rows[0])
    assert rows[0]["prompt_tokens"] == 16
    _check_ok_row(rows[1])


def test_truncate_error_stops_the_job_naming_the_fix(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog", LONG]})
    r = _run(
        src, tmp_path / "out", model, "--max-prompt-len", 16, "--truncate", "error", exit_code=1
    )
    assert "max_prompt_len 16" in r.stderr
    assert "--truncate left|right|skip" in r.stderr and "--max-prompt-len" in r.stderr
    assert not success(tmp_path / "out")


# --- a bad input fails fast, before any model is loaded ---


@pytest.fixture
def unloadable_model(tmp_path, model, monkeypatch):
    """The tiny model's config and tokenizer with weights that cannot load; loading is also
    patched to fail the test, so an error here can only come from checking the input."""
    broken = tmp_path / "broken-model"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")

    def load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("batchgen.runner.run.LLM", load)
    monkeypatch.setattr("batchgen.parallel.rank_model.load_model", load)
    return broken


def _corrupt_parquet(d):
    (d / "bad.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    return d / "bad.parquet", [], ["cannot read Parquet file", "bad.parquet"]


def _truncated_parquet(d):
    write_parquet(d / "full.parquet", {"prompt": ["the lazy dog"] * 100})
    data = (d / "full.parquet").read_bytes()
    (d / "cut.parquet").write_bytes(data[: len(data) // 2])
    return d / "cut.parquet", [], ["cannot read Parquet file", "cut.parquet"]


def _missing_prompt_column(d):
    src = write_parquet(d / "in.parquet", {"text": ["the lazy dog"]})
    return src, [], ["no column(s) 'prompt'", "available columns: 'text'", "--prompt-column text"]


def _missing_template_column(d):
    src = write_parquet(d / "in.parquet", {"text": ["the lazy dog"]})
    return src, ["-t", "{{ txt }}"], ["no column(s) 'txt'"]


def _missing_id_column(d):
    src = write_parquet(d / "in.parquet", {"prompt": ["the lazy dog"]})
    return src, ["--id-column", "uid"], ["no column(s) 'uid'"]


def _missing_file(d):
    return d / "nope.parquet", [], ["does not exist"]


def _jsonl_type_change(d):
    src = d / "in.jsonl"
    src.write_text('{"prompt": "the lazy dog"}\n{"prompt": 5}\n')
    return src, [], ["in.jsonl", "changed from string to number on line 2", "convert to Parquet"]


def _json_array(d):
    src = d / "in.json"
    src.write_text('[{"prompt": "the lazy dog"}]')
    return src, [], ["JSON Lines", "jq"]


def _template_syntax(d):
    src = write_parquet(d / "in.parquet", {"text": ["the lazy dog"]})
    return src, ["-t", "{{ text "], ["template does not compile"]


@pytest.mark.parametrize(
    "make",
    [
        _corrupt_parquet,
        _truncated_parquet,
        _missing_prompt_column,
        _missing_template_column,
        _missing_id_column,
        _missing_file,
        _jsonl_type_change,
        _json_array,
        _template_syntax,
    ],
)
def test_bad_input_fails_before_the_model_loads(tmp_path, unloadable_model, make):
    src, flags, words = make(tmp_path)
    out = tmp_path / "out"
    r = _run(src, out, unloadable_model, *flags, exit_code=2)
    assert r.stderr.startswith("Error: ")
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert "Traceback" not in r.stderr
    assert not out.exists()  # nothing written either


def test_plan_reports_bad_input_the_same_way(tmp_path, unloadable_model):
    src, _, words = _corrupt_parquet(tmp_path)
    r = run_cli("plan", src, "--model", unloadable_model, exit_code=2)
    assert words[0] in r.stderr
