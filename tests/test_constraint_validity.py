"""Constrained rows that end `stop` meet their constraint (issue 22): JSON strings without raw
control characters, an unsatisfiable constraint refused before the run, compact JSON
whitespace by default, and a row cut at max_new_tokens marked as incomplete."""

import json
import re

from helpers import assert_one_line_error, prompt_file, read_stats, rows_by_id, run_job, success

SAMPLED = ("--temperature", 1.0, "--seed", 7)
NEVER = r"[^\s\S]"  # a regex no text matches, not even the empty one


def _schema(tmp_path, schema: dict):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return path


def test_json_strings_hold_no_raw_control_characters(tmp_path, model):
    # The tiny model's byte-level BPE has a token for every control byte; xgrammar 0.2.9's
    # maxLength string rule allowed them. 32 sampled rows: before the fix 5-14 failed.
    schema = _schema(tmp_path, {"type": "string", "maxLength": 6})
    src = prompt_file(tmp_path, 32)
    out = tmp_path / "out"
    run_job(src, out, model, *SAMPLED, "--max-new-tokens", 12, "--json-schema", schema)
    rows = rows_by_id(out)
    done = [r for r in rows.values() if r["finish_reason"] == "stop"]
    assert len(done) >= 16
    for r in done:
        value = json.loads(r["generated_text"], strict=True)  # strict: no raw U+0000-U+001F
        assert isinstance(value, str) and len(value) <= 6
        assert not any(ord(ch) < 0x20 for ch in r["generated_text"]), repr(r["generated_text"])


def test_unsatisfiable_job_constraint_is_refused_before_the_run(tmp_path, model):
    src = prompt_file(tmp_path, 4)
    r = run_job(src, tmp_path / "out", model, "--regex", NEVER, exit_code=2)
    assert_one_line_error(r, "--regex", "cannot be met")
    assert not success(tmp_path / "out")


def test_unsatisfiable_row_constraint_is_that_rows_error(tmp_path, model):
    regex = [NEVER, None, NEVER, r"[a-c]{2}"]
    src = prompt_file(tmp_path, 4, regex=regex)
    out = tmp_path / "out"
    run_job(src, out, model, *SAMPLED, "--max-new-tokens", 8)
    rows = rows_by_id(out)
    for i in (0, 2):  # never a `stop` row with text "" that fails its constraint
        assert rows[i]["finish_reason"] == "error"
        assert "cannot be met" in rows[i]["error"]
        assert rows[i]["generated_text"] is None
    assert rows[1]["error"] is None and rows[3]["error"] is None
    assert rows[3]["finish_reason"] == "stop" and len(rows[3]["generated_text"]) == 2


_OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
    "required": ["a", "b"],
}


def _json_rows(tmp_path, model, name: str, *flags):
    schema = _schema(tmp_path, _OBJECT)
    src = prompt_file(tmp_path, 16)
    out = tmp_path / name
    run_job(src, out, model, *SAMPLED, "--max-new-tokens", 48, "--json-schema", schema, *flags)
    return rows_by_id(out)


def test_json_whitespace_is_compact_by_default(tmp_path, model):
    rows = _json_rows(tmp_path, model, "compact")
    done = [r["generated_text"] for r in rows.values() if r["finish_reason"] == "stop"]
    assert len(done) >= 8
    for text in done:  # the only whitespace: one space after each , and :
        json.loads(text, strict=True)
        assert "\n" not in text and "\t" not in text and "\r" not in text and "  " not in text
        assert not text[0].isspace() and not text[1].isspace()


def test_json_any_whitespace_option_allows_free_whitespace(tmp_path, model):
    rows = _json_rows(tmp_path, model, "free", "--json-any-whitespace")
    texts = [r["generated_text"] for r in rows.values() if r["generated_text"] is not None]
    assert any(ch in t for t in texts for ch in "\n\t\r")  # a random model uses the freedom


def test_constrained_row_cut_at_max_new_tokens_is_marked_incomplete(tmp_path, model):
    schema = _schema(tmp_path, _OBJECT)
    src = prompt_file(tmp_path, 4)
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 3, "--json-schema", schema)
    rows = rows_by_id(out)
    for r in rows.values():
        assert r["finish_reason"] == "length"
        assert r["generated_text"]  # what was generated is kept
        assert "does not complete" in r["error"]
    # counted as errors: an incomplete JSON answer is not a result
    assert read_stats(out)["rows_error"] == 4
    # an unconstrained row cut at the limit is a plain `length` row
    run_job(src, tmp_path / "plain", model, "--max-new-tokens", 3)
    assert all(r["error"] is None for r in rows_by_id(tmp_path / "plain").values())


def test_exclude_controls_patches_classes_but_not_quoted_text():
    from batchgen.engine.constraints import exclude_controls

    ebnf = r'root ::= ("\"[^x" [^\"\\\r\n]{0, 6} [^\0-\x1f\"] "\"")'
    out = exclude_controls(ebnf)
    assert out == r'root ::= ("\"[^x" [^\0-\x1f\"\\\r\n]{0, 6} [^\0-\x1f\"] "\"")'


def test_a_stop_string_that_cuts_a_constrained_row_marks_it(tmp_path, model):
    src = prompt_file(tmp_path, 16)
    out = tmp_path / "out"
    flags = ("--regex", "[a-c]{4}", "--stop", "b", "--max-new-tokens", 8)
    run_job(src, out, model, *SAMPLED, *flags)
    rows = rows_by_id(out).values()
    cut = [r for r in rows if r["error"] is not None]
    assert cut, "no row was cut: pick another seed"
    for r in rows:
        assert r["finish_reason"] == "stop"
        if re.fullmatch("[a-c]{4}", r["generated_text"]):
            assert r["error"] is None
        else:  # cut before the b: kept, but not passed off as a match
            assert "b" not in r["generated_text"] and "stop string cut" in r["error"]
