"""Small traps of issue 31: a missing output names -o/--output, an inline --json-schema, an
OpenAI JSON-mode line cut at max_tokens is a 200 with finish_reason "length", and `plan --n 4`
shows prompts and samples apart."""

from __future__ import annotations

import json

from helpers import EAGER, assert_one_line_error, run_cli, run_job, write_jsonl, write_parquet

from batchgen.data.layout import RESULTS_FILE

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


def test_missing_output_names_the_flag(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog"]})
    r = run_cli("run", src, "--model", model, exit_code=2)
    assert_one_line_error(r, "missing output", "-o/--output")


def test_inline_json_schema(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog", "the fox"]})
    out = tmp_path / "out"
    run_job(src, out, model, "--json-schema", SCHEMA, "--max-new-tokens", 24)
    r = run_cli("run", src, "-o", tmp_path / "bad", "--json-schema", "{nope", exit_code=2)
    assert_one_line_error(r, "inline schema is not JSON")


def test_openai_json_mode_cut_at_max_tokens_is_200_length(tmp_path, model):
    body = {"messages": [{"role": "user", "content": "the fox"}], "max_tokens": 2}
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(2)
    ]
    src = write_jsonl(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "out"
    run_job(src, out, model, "--json-schema", SCHEMA, "--output-format", "openai")
    results = [json.loads(x) for x in (out / RESULTS_FILE).read_text().splitlines()]
    assert len(results) == 2
    for line in results:
        assert line["response"]["status_code"] == 200 and line["error"] is None, line
        assert line["response"]["body"]["choices"][0]["finish_reason"] == "length"


def test_plan_shows_prompts_and_samples_apart(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [f"the fox {i}" for i in range(6)]})
    r = run_cli("plan", src, "--model", model, *EAGER, "--n", 4, "--temperature", 0.7)
    assert "6 prompts, 24 output rows" in r.stdout, r.stdout
    r = run_cli("plan", src, "--model", model, *EAGER)
    assert "rows    6 (" in r.stdout, r.stdout
