"""OpenAI batch request files as input: the parser on hand-made lines, then jobs through the CLI."""

import json

import pyarrow as pa
import pytest
from helpers import (
    assert_one_line_error,
    read_output,
    read_stats,
    rows_by_id,
    run_job,
    success,
    write_jsonl,
    write_parquet,
)
from transformers import AutoTokenizer

from batchgen.data import InputFormat, open_input
from batchgen.data.layout import RESULTS_FILE
from batchgen.data.openai_batch import OPENAI_ERROR_COLUMN, is_openai_batch, parse_line
from batchgen.data.openai_output import write_results

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat_line(cid, content, **body):
    messages = [{"role": "user", "content": content}]
    return {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "any", "messages": messages, **body},
    }


def completion_line(cid, prompt, **body):
    return {
        "custom_id": cid,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"model": "any", "prompt": prompt, **body},
    }


def parse(obj, lineno=1):
    return parse_line(obj if isinstance(obj, str) else json.dumps(obj), lineno)


# -- the parser ------------------------------------------------------------------------------


def test_parse_chat_line_maps_every_field():
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    rec, unsupported = parse(
        chat_line(
            "a",
            "hi",
            max_completion_tokens=7,
            max_tokens=99,
            temperature=0.5,
            top_p=0.9,
            seed=4,
            stop="\n",
            n=2,
            logprobs=True,
            tools=[],
            logit_bias={"1": 2},
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    )
    assert rec == {
        "custom_id": "a",
        "prompt": None,
        "messages": json.dumps([{"role": "user", "content": "hi"}]),
        "max_new_tokens": 7,  # max_completion_tokens wins over the older max_tokens
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 4,
        "stop": ["\n"],
        "n": 2,
        "logprobs": True,
        "top_logprobs": None,
        "json_schema": json.dumps(schema),
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "logit_bias": '{"1": 2}',  # JSON text: the row's logit_bias column
        "model": "any",
        "embeddings": False,  # a chat line, not /v1/embeddings
        "dimensions": None,  # an embeddings line's
        "encoding_format": None,
        OPENAI_ERROR_COLUMN: None,
    }
    assert unsupported == ["tools"]


def test_parse_completion_line():
    rec, unsupported = parse(
        completion_line(
            "b",
            "the lazy dog",
            max_tokens=3,
            stop=["x", "y"],
            logprobs=0,
            response_format={"type": "json_object"},
        )
    )
    assert (rec["prompt"], rec["messages"], rec["max_new_tokens"]) == ("the lazy dog", None, 3)
    assert (rec["stop"], rec["logprobs"]) == (["x", "y"], True)
    assert json.loads(rec["json_schema"]) == {"type": "object"}
    assert rec["temperature"] is None and rec["seed"] is None and rec[OPENAI_ERROR_COLUMN] is None
    assert unsupported == []


@pytest.mark.parametrize(
    "line, cid, words",
    [
        ("{not json", "line-5", ["line 5", "not JSON"]),
        ("[1, 2]", "line-5", ["line 5", "list, not an object"]),
        ({"body": {"prompt": "x"}, "url": COMPLETIONS}, "line-5", ["no custom_id"]),
        ({"custom_id": 3, "url": COMPLETIONS, "body": {}}, "line-5", ["custom_id is 3"]),
        ({"custom_id": "c", "url": COMPLETIONS}, "c", ["no body"]),
        ({"custom_id": "c", "url": "/v1/rerank", "body": {"input": "x"}}, "c", ["url"]),
        ({"custom_id": "c", "url": CHAT, "body": {"prompt": "x"}}, "c", ["messages"]),
        ({"custom_id": "c", "url": COMPLETIONS, "body": {"messages": []}}, "c", ["no prompt"]),
        ({"custom_id": "c", "url": COMPLETIONS, "body": {"prompt": [1, 2]}}, "c", ["list"]),
        (completion_line("c", "x", max_tokens="8"), "c", ["max_tokens", "not an integer"]),
        (completion_line("c", "x", max_tokens=0), "c", ["max_tokens is 0"]),
        (completion_line("c", "x", temperature="hot"), "c", ["temperature", "not a number"]),
        (completion_line("c", "x", seed=1.5), "c", ["seed"]),
        (completion_line("c", "x", stop=[1]), "c", ["stop"]),
        (chat_line("c", "x", logprobs=3), "c", ["logprobs"]),
        (chat_line("c", "x", response_format={"type": "yaml"}), "c", ["response_format"]),
        ({**completion_line("c", "x"), "method": "GET"}, "c", ["GET"]),
    ],
)
def test_malformed_lines_are_one_line_row_errors(line, cid, words):
    rec, _ = parse(line, lineno=5)
    err = rec[OPENAI_ERROR_COLUMN]
    assert rec["custom_id"] == cid and "\n" not in err and err.startswith("OpenAI batch line 5: ")
    for w in words:
        assert w in err, (w, err)
    assert all(rec[k] is None for k in rec if k not in ("custom_id", OPENAI_ERROR_COLUMN))


def test_detection(tmp_path):
    batch = tmp_path / "req.jsonl"
    batch.write_text("\n\n" + json.dumps(completion_line("a", "x")) + "\nnot json\n")
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "x", "body": "y"}])
    assert is_openai_batch(str(batch)) and not is_openai_batch(str(plain))
    source = open_input(batch)
    assert source.format is InputFormat.OPENAI and source.num_rows == 2
    assert open_input(plain).format is InputFormat.JSONL


# -- jobs through the CLI --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(model):
    return AutoTokenizer.from_pretrained(model)


def _run(src, out, model, *flags):
    return run_job(src, out, model, "--max-new-tokens", 8, *flags)


CHATS = ["label the sentiment of this review: great product", "the quick brown fox"]
PROMPTS = ["a static cache keeps every shape fixed", "summarise the text in one sentence."]


def test_duplicate_custom_id_fails_before_the_model_loads(tmp_path, model):
    src = write_jsonl(tmp_path / "req.jsonl", [completion_line("a", "x"), chat_line("a", "y")])
    r = run_job(src, tmp_path / "out", model, exit_code=None)
    assert r.exit_code != 0
    assert_one_line_error(r, "custom_id 'a'", "line 1", "line 2")
    assert not (tmp_path / "out").exists()


def test_mixed_file_equals_plain_runs(tmp_path, model, tok):
    """Greedy output of chat and completion lines, each with its own max_tokens and seed, equals
    plain `batchgen run`s over the same prompts (--messages-column for the chat lines)."""
    lines = [
        chat_line("c0", CHATS[0], max_tokens=5, seed=1),
        completion_line("p0", PROMPTS[0], max_tokens=3, seed=2),
        chat_line("c1", CHATS[1], max_completion_tokens=6),
        completion_line("p1", PROMPTS[1]),  # the job's --max-new-tokens 8
    ]
    out = tmp_path / "out"
    _run(write_jsonl(tmp_path / "req.jsonl", lines), out, model)
    # The parts keep the input's id column, custom_id, under its name.
    names = read_output(out).schema.names
    assert names[0] == "custom_id" and "id" not in names
    rows = rows_by_id(out, "custom_id")
    assert sorted(rows) == ["c0", "c1", "p0", "p1"]

    plain = write_parquet(tmp_path / "p.parquet", {"prompt": PROMPTS, "max_new_tokens": [3, 8]})
    _run(plain, tmp_path / "plain", model)
    msgs = [json.dumps([{"role": "user", "content": c}]) for c in CHATS]
    chats = write_parquet(tmp_path / "c.parquet", {"messages": msgs, "max_new_tokens": [5, 6]})
    _run(chats, tmp_path / "chat", model, "--messages-column", "messages")
    want = {
        **{f"p{i}": r for i, r in rows_by_id(tmp_path / "plain").items()},
        **{f"c{i}": r for i, r in rows_by_id(tmp_path / "chat").items()},
    }
    for cid, row in rows.items():
        assert row["error"] is None, row
        keys = ("generated_text", "finish_reason", "prompt_tokens", "completion_tokens")
        assert {k: row[k] for k in keys} == {k: want[cid][k] for k in keys}, cid
    assert [rows[c]["completion_tokens"] for c in ("c0", "p0", "c1")] == [5, 3, 6]
    # The request's prompt travels with its row; the chat one through the model's template.
    assert rows["p0"]["prompt"] == PROMPTS[0] and rows["p0"]["messages"] is None
    assert json.loads(rows["c0"]["messages"]) == [{"role": "user", "content": CHATS[0]}]
    rendered = tok.apply_chat_template(
        json.loads(msgs[0]), tokenize=False, add_generation_prompt=True
    )
    assert rows["c0"]["prompt_tokens"] == len(tok(rendered, add_special_tokens=False)["input_ids"])


def test_malformed_lines_become_error_rows(tmp_path, model):
    text = (
        "\n".join(
            [
                json.dumps(completion_line("ok0", PROMPTS[0])),
                "{truncated",
                json.dumps({"custom_id": "u", "url": "/v1/embeddings", "body": {"input": "x"}}),
                json.dumps(chat_line("t", "x", temperature="warm")),
                "",
                json.dumps(chat_line("ok1", CHATS[1])),
            ]
        )
        + "\n"
    )
    src = tmp_path / "req.jsonl"
    src.write_text(text)
    out = tmp_path / "out"
    _run(src, out, model)
    rows = rows_by_id(out, "custom_id")
    assert sorted(rows) == ["line-2", "ok0", "ok1", "t", "u"]
    for cid, words in {
        "line-2": ["line 2", "not JSON"],
        "u": ["url", "--task embed"],  # an embeddings line (a --task embed job's)
        "t": ["line 4", "temperature"],
    }.items():
        row = rows[cid]
        assert row["finish_reason"] == "error" and row["generated_text"] is None
        assert all(w in row["error"] for w in words), row["error"]
    for cid in ("ok0", "ok1"):
        assert rows[cid]["error"] is None and rows[cid]["completion_tokens"] >= 1
    stats = read_stats(out)
    assert stats["rows_error"] == 3 and success(out)


def test_unsupported_fields_are_reported(tmp_path, model, caplog):
    lines = [
        chat_line("a", CHATS[0], tools=[{"type": "function"}], user="x"),
        completion_line("b", PROMPTS[0], user="y", suffix="!"),
        completion_line("c", PROMPTS[1]),
    ]
    out = tmp_path / "out"
    _run(write_jsonl(tmp_path / "req.jsonl", lines), out, model)
    assert read_stats(out)["openai_unsupported_fields"] == {
        "suffix": 1,
        "tools": 1,
        "user": 2,
    }
    warnings = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert len(warnings) == 1
    assert all(w in warnings[0] for w in ("user (2 lines)", "tools (1 line)"))
    assert all(r["error"] is None for r in rows_by_id(out, "custom_id").values())


def test_per_row_stop_cuts_only_its_row(tmp_path, model):
    """The first run finds what a row writes; a stop string from inside that text, given on one
    line only, cuts that line and leaves the same prompt on another line as it was."""
    ref = tmp_path / "ref"
    _run(write_jsonl(tmp_path / "ref.jsonl", [completion_line("a", PROMPTS[0])]), ref, model)
    text = rows_by_id(ref, "custom_id")["a"]["generated_text"]
    stop = text[len(text) // 2 :][:2]
    assert stop.strip() and text.index(stop) > 0, text
    lines = [completion_line("cut", PROMPTS[0], stop=[stop]), completion_line("same", PROMPTS[0])]
    out = tmp_path / "out"
    _run(write_jsonl(tmp_path / "req.jsonl", lines), out, model)
    rows = rows_by_id(out, "custom_id")
    assert rows["cut"]["generated_text"] == text[: text.index(stop)]
    assert rows["cut"]["finish_reason"] == "stop"
    assert rows["same"]["generated_text"] == text


def test_stop_column_in_a_plain_input_overrides_the_job_stop(tmp_path, model):
    ref = tmp_path / "ref"
    _run(write_parquet(tmp_path / "r.parquet", {"prompt": [PROMPTS[0]]}), ref, model)
    text = rows_by_id(ref)[0]["generated_text"]
    stop = text[len(text) // 2 :][:2]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [PROMPTS[0]] * 2, "stop": [stop, None]})
    _run(src, tmp_path / "out", model, "--stop", "nothing-like-this")
    rows = rows_by_id(tmp_path / "out")
    assert (
        rows[0]["generated_text"] == text[: text.index(stop)] and rows[1]["generated_text"] == text
    )


# -- --output-format openai ------------------------------------------------------------------


def _results(out):
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def test_openai_output_lines_in_input_order(tmp_path, model):
    lines = [
        completion_line("z-last-id", PROMPTS[1], max_tokens=3),
        "{broken",
        chat_line("a-first-id", CHATS[0], max_tokens=5),
        completion_line("too-long", "the quick brown fox " * 60, max_tokens=100),
        chat_line("m", CHATS[1]),
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    out = tmp_path / "out"
    _run(src, out, model, "--output-format", "openai")
    rows = rows_by_id(out, "custom_id")
    got = _results(out)
    assert [g["custom_id"] for g in got] == ["z-last-id", "line-2", "a-first-id", "too-long", "m"]
    assert len({g["id"] for g in got}) == len({g["response"]["request_id"] for g in got}) == 5
    for g in got:
        row, resp = rows[g["custom_id"]], g["response"]
        if row["error"] is not None:
            assert resp["status_code"] == 400 and resp["body"] is None
            assert g["error"]["message"] == row["error"]
            continue
        assert resp["status_code"] == 200 and g["error"] is None
        body = resp["body"]
        assert body["model"] == "any"  # the request's model, echoed
        assert body["usage"] == {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
        }
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == row["finish_reason"]
        if g["custom_id"] in ("a-first-id", "m"):
            assert body["object"] == "chat.completion"
            assert choice["message"] == {"role": "assistant", "content": row["generated_text"]}
        else:
            assert body["object"] == "text_completion" and choice["text"] == row["generated_text"]
    assert [g["response"]["status_code"] for g in got] == [200, 400, 200, 400, 200]
    assert "line 2" in got[1]["error"]["message"] and "positions" in got[3]["error"]["message"]

    # A rerun of the complete job, and one that added the option afterwards, write the same lines.
    plain = tmp_path / "plain"
    _run(src, plain, model)
    assert not (plain / RESULTS_FILE).exists()
    _run(src, plain, model, "--output-format", "openai")
    strip = [
        {
            **g,
            "response": {
                **g["response"],
                "body": g["response"]["body"] and {**g["response"]["body"], "created": 0},
            },
        }
        for g in got
    ]
    again = [
        {
            **g,
            "response": {
                **g["response"],
                "body": g["response"]["body"] and {**g["response"]["body"], "created": 0},
            },
        }
        for g in _results(plain)
    ]
    assert again == strip


def test_openai_output_into_a_results_file_as_vllm_run_batch_writes_it(tmp_path, model):
    lines = [completion_line("a", PROMPTS[0], max_tokens=3), chat_line("b", CHATS[0])]
    src = write_jsonl(tmp_path / "req.jsonl", lines)
    results = tmp_path / "results.jsonl"  # `vllm run-batch -i req.jsonl -o results.jsonl`
    _run(src, results, model, "--output-format", "openai")
    got = [json.loads(x) for x in results.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["a", "b"] and got[0]["error"] is None
    state = tmp_path / ".results.jsonl.batchgen"  # the parts and the job, beside the file
    assert success(state) and len(rows_by_id(state, "custom_id")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [state.name, "req.jsonl", results.name]
    r = _run(src, results, model, "--output-format", "openai")  # a rerun resumes from there
    assert "were done before" in r.stdout
    assert [json.loads(x)["custom_id"] for x in results.read_text().splitlines()] == ["a", "b"]


def test_openai_output_needs_an_openai_input(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    r = run_job(src, tmp_path / "out", model, "--output-format", "openai", exit_code=None)
    assert r.exit_code != 0
    assert_one_line_error(r, "OpenAI batch request file")
    r = run_job(
        src, tmp_path / "out", model, "--output-format", "openai", "--shard", "0/2", exit_code=None
    )
    assert_one_line_error(r, "shard")


def test_output_lines_of_several_samples(tmp_path):
    """Results with a sample_index (n samples of a request) are one line with a choice each."""
    requests = pa.table(
        {
            "custom_id": ["x", "y", "z"],
            "messages": ["[]", None, None],
            "logprobs": pa.array([None] * 3, pa.bool_()),
        }
    )
    results = pa.table(
        {
            "custom_id": ["y", "x", "x", "z", "z"],
            "sample_index": [0, 1, 0, 0, 1],
            "generated_text": ["t", "b", "a", "ok", None],
            "finish_reason": ["length", "stop", "length", "stop", "error"],
            "prompt_tokens": [3, 5, 5, 2, 0],
            "completion_tokens": [4, 1, 2, 1, 0],
            "error": [None, None, None, None, "engine error"],
        }
    )
    assert write_results(str(tmp_path), requests, results, "m", created=7) == 3
    x, y, z = _results(tmp_path)
    body = x["response"]["body"]
    assert body["object"] == "chat.completion" and body["created"] == 7
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "length"),
        (1, "b", "stop"),
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert y["response"]["body"]["choices"][0]["text"] == "t"
    assert z["response"]["status_code"] == 400 and z["error"]["message"] == "engine error"


def test_n_and_response_format_are_applied(tmp_path, model):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    lines = [
        completion_line("json", PROMPTS[0], max_tokens=40, response_format=fmt),
        completion_line("three", PROMPTS[1], max_tokens=4, n=3, temperature=1.0),
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    _run(src, out, model, "--output-format", "openai")
    got = {g["custom_id"]: g["response"]["body"]["choices"] for g in _results(out)}
    (only,) = got["json"]
    assert json.loads(only["text"]) in ({"ok": True}, {"ok": False})
    assert [c["index"] for c in got["three"]] == [0, 1, 2]
    assert len({c["text"] for c in got["three"]}) > 1  # three independent samples


def test_logprobs_asked_for_are_in_the_output_lines(tmp_path, model):
    lines = [
        chat_line("c", CHATS[0], max_tokens=4, logprobs=True),
        completion_line("p", PROMPTS[0], max_tokens=3, logprobs=0),
        completion_line("q", PROMPTS[1], max_tokens=3),
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    _run(src, out, model, "--output-format", "openai")
    rows = rows_by_id(out, "custom_id")
    c, p, q = _results(out)
    content = c["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx(rows["c"]["logprobs"])
    assert (
        "".join(e["token"] for e in content)
        == c["response"]["body"]["choices"][0]["message"]["content"]
    )
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"] == [] for e in content)
    lp = p["response"]["body"]["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(rows["p"]["logprobs"]) and len(lp["tokens"]) == 3
    assert lp["text_offset"][0] == 0 and lp["top_logprobs"] is None
    assert q["response"]["body"]["choices"][0]["logprobs"] is None  # not asked for


# -- issue 22: n's bound, a BOM, made-up ids, content parts, logprobs false, model, EOS ---------


def test_n_above_openais_bound_is_an_error_line(tmp_path, model):
    rec, _ = parse(completion_line("big", "x", n=100_000_000))
    assert "n is 100000000, above 128" in rec[OPENAI_ERROR_COLUMN]
    assert parse(completion_line("ok", "x", n=128))[0]["n"] == 128
    lines = [completion_line("big", PROMPTS[0], n=100_000_000), completion_line("ok", PROMPTS[1])]
    src = write_jsonl(tmp_path / "req.jsonl", lines)
    _run(src, tmp_path / "out", model)
    rows = rows_by_id(tmp_path / "out", "custom_id")
    assert "above 128" in rows["big"]["error"] and rows["ok"]["error"] is None


def test_a_byte_order_mark_keeps_the_first_request(tmp_path):
    src = tmp_path / "req.jsonl"
    lines = [completion_line("first", "x"), completion_line("second", "y")]
    src.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(x) + "\n" for x in lines).encode())
    source = open_input(src)
    assert source.format is InputFormat.OPENAI
    table = source.requests
    assert table.column("custom_id").to_pylist() == ["first", "second"]
    assert source._table.column(OPENAI_ERROR_COLUMN).null_count == 2


def test_a_made_up_custom_id_never_takes_a_real_one(tmp_path):
    src = tmp_path / "req.jsonl"
    real = [completion_line("line-2", "x"), completion_line("line-2~2", "y")]
    src.write_text(json.dumps(real[0]) + "\n{broken\n" + json.dumps(real[1]) + "\n")
    ids = open_input(src).requests.column("custom_id").to_pylist()
    assert ids == ["line-2", "line-2~3", "line-2~2"]


def test_content_parts_and_logprobs_false(tmp_path, model, tok):
    parts = [{"type": "text", "text": "label the sentiment"}, {"type": "text", "text": "great"}]
    rec, _ = parse(chat_line("c", parts, logprobs=False))
    assert rec[OPENAI_ERROR_COLUMN] is None and rec["logprobs"] is False
    assert json.loads(rec["messages"])[0]["content"] == "label the sentiment\ngreat"
    rec, _ = parse(completion_line("p", "x", logprobs=False))
    assert rec[OPENAI_ERROR_COLUMN] is None and rec["logprobs"] is False
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    rec, _ = parse(chat_line("i", image))
    assert "'image_url'" in rec[OPENAI_ERROR_COLUMN]


def test_output_echoes_the_model_and_leaves_eos_out_of_logprobs(tmp_path):
    requests = pa.table(
        {
            "custom_id": ["a", "b"],
            "messages": ["[]", None],
            "logprobs": [True, True],
            "model": ["gpt-4o-mini", None],
        }
    )
    results = pa.table(
        {
            "custom_id": ["a", "b"],
            "generated_text": ["xy", "z"],
            "finish_reason": ["stop", "stop"],
            "prompt_tokens": [3, 3],
            "completion_tokens": [3, 1],
            "error": [None, None],
            "token_ids": [[5, 6, 1], [7]],
            "logprobs": [[-0.5, -0.25, -0.125], [-1.0]],
        }
    )
    text = {5: "x", 6: "y", 7: "z", 1: "<eos>"}.__getitem__
    write_results(str(tmp_path), requests, results, "/local/m", text, eos_ids=[1])
    a, b = _results(tmp_path)
    assert a["response"]["body"]["model"] == "gpt-4o-mini"
    assert b["response"]["body"]["model"] == "/local/m"
    content = a["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in content] == [("x", -0.5), ("y", -0.25)]
    assert b["response"]["body"]["choices"][0]["logprobs"]["tokens"] == ["z"]


def test_top_logprobs_are_parsed_within_openais_bounds():
    rec, _ = parse(chat_line("c", "x", logprobs=True, top_logprobs=3))
    assert rec["top_logprobs"] == 3 and rec[OPENAI_ERROR_COLUMN] is None
    assert parse(completion_line("p", "x", logprobs=2))[0]["top_logprobs"] == 2
    assert parse(completion_line("p", "x", logprobs=0))[0]["top_logprobs"] is None
    for line, words in [
        (chat_line("c", "x", top_logprobs=2), "needs logprobs"),
        (chat_line("c", "x", logprobs=True, top_logprobs=21), "above 20"),
        (completion_line("p", "x", logprobs=6), "above 5"),
    ]:
        assert words in parse(line)[0][OPENAI_ERROR_COLUMN]


def test_top_logprobs_are_computed(tmp_path, model, tok):
    lines = [
        chat_line("c", CHATS[0], max_tokens=4, logprobs=True, top_logprobs=3),
        completion_line("p", PROMPTS[0], max_tokens=3, logprobs=2),
        completion_line("q", PROMPTS[1], max_tokens=3, logprobs=True),
    ]
    src = write_jsonl(tmp_path / "req.jsonl", lines)
    out = tmp_path / "out"
    _run(src, out, model, "--output-format", "openai")
    rows = rows_by_id(out, "custom_id")
    c, p, q = _results(out)
    content = c["response"]["body"]["choices"][0]["logprobs"]["content"]
    ids = rows["c"]["token_ids"]
    assert len(content) == len(rows["c"]["top_logprobs"]) >= 1
    for i, e in enumerate(content):
        alts = e["top_logprobs"]
        assert len(alts) == 3
        assert [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts), reverse=True)
        # greedy: the likeliest alternative is the token chosen, with its logprob
        assert rows["c"]["top_logprobs"][i][0]["id"] == ids[i]
        assert alts[0]["token"] == e["token"]
        assert alts[0]["logprob"] == pytest.approx(e["logprob"], abs=1e-5)
        assert all(a["bytes"] == list(a["token"].encode()) for a in alts)
    lp = p["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(lp["tokens"]) >= 1
    assert all(1 <= len(d) <= 2 and all(v <= 0 for v in d.values()) for d in lp["top_logprobs"])
    assert q["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"] is None
    assert rows["q"]["top_logprobs"] is None
