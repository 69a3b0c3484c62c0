"""OpenAI batch request files (the lines `vllm run-batch` reads) as an input.

A .jsonl file whose first non-blank line is an object with `custom_id` and `body` is one: each
line is a POST to `/v1/chat/completions` (body.messages) or `/v1/completions` (body.prompt).
Each line becomes one row of the columns the pipeline already uses: `custom_id` (the row id),
`prompt` or `messages` (JSON text, rendered with the chat template), the per-row overrides
`max_new_tokens`, `temperature`, `top_p`, `seed`, `stop`, and `n`, `logprobs`, `json_schema`.

A malformed line is not a failed job: its row carries `OPENAI_ERROR_COLUMN`, a one-line message
naming the line, and becomes an error record. Body fields with no mapping are counted per name
(`unsupported_fields`) so the job can report them. OpenAI caps a batch file at 50,000 lines and
200 MB, so the file is parsed whole when opened: the row count, duplicate ids and the unsupported
fields are then known before a model loads.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from batchgen.errors import InputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
OPENAI_ERROR_COLUMN = "openai_error"  # the parse error of a malformed line, else null

SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("prompt", pa.string()),
        ("messages", pa.string()),  # the body's messages as JSON text
        ("max_new_tokens", pa.int64()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("seed", pa.int64()),
        ("stop", pa.list_(pa.string())),
        ("n", pa.int64()),
        ("logprobs", pa.bool_()),
        ("json_schema", pa.string()),  # JSON text of the schema to follow
        ("model", pa.string()),  # the body's model, echoed in the output lines
        (OPENAI_ERROR_COLUMN, pa.string()),
    ]
)
# Body fields that map to a column.
MAPPED_FIELDS = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "logprobs",
        "response_format",
    }
)
_PARSE_ROWS = 4096  # lines per Arrow batch while parsing
MAX_N = 128  # OpenAI's bound on a request's n: a line asking for more is an error line


class LineError(Exception):
    pass


def is_openai_batch(file: str) -> bool:
    """True when the file's first non-blank line is a JSON object with custom_id and body."""
    with open(file, "rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return False
                return isinstance(first, dict) and "custom_id" in first and "body" in first
    return False


def parse_line(text: str, lineno: int, file: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Line `lineno` (1-based) -> (row record, the body's unsupported field names).

    A malformed line gives a record with only `custom_id` (the line's, or `line-N`, prefixed
    with `file:` when given, where it has none) and OPENAI_ERROR_COLUMN set."""
    record, unsupported, _ = _parse_line(text, lineno, file)
    return record, unsupported


def _parse_line(text: str, lineno: int, file: str | None) -> tuple[dict[str, Any], list[str], bool]:
    """parse_line's record and unsupported fields, and whether the custom_id was made up."""
    record: dict[str, Any] = dict.fromkeys(SCHEMA.names)
    record["custom_id"] = f"{file}:line-{lineno}" if file else f"line-{lineno}"
    generated = True
    unsupported: list[str] = []
    try:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise LineError(f"not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise LineError(f"a JSON {type(obj).__name__}, not an object")
        cid = obj.get("custom_id")
        if isinstance(cid, str) and cid:
            record["custom_id"], generated = cid, False
        elif "custom_id" not in obj:
            raise LineError("no custom_id")
        else:
            raise LineError(f"custom_id is {cid!r}, not a non-empty string")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise LineError("no body object" if body is None else "body is not an object")
        unsupported = sorted(k for k in body if k not in MAPPED_FIELDS)
        if obj.get("method", "POST") != "POST":
            raise LineError(f"method {obj['method']!r} is not POST")
        _parse_body(obj.get("url"), body, record)
    except LineError as e:
        record = {**dict.fromkeys(SCHEMA.names), "custom_id": record["custom_id"]}
        where = f"{file} line {lineno}" if file else f"line {lineno}"
        record[OPENAI_ERROR_COLUMN] = f"OpenAI batch {where}: {e}"
    return record, unsupported, generated


def _parse_body(url: Any, body: dict[str, Any], record: dict[str, Any]) -> None:
    if url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise LineError(f"a {CHAT_URL} body needs a non-empty messages list")
        record["messages"] = json.dumps([_message(m) for m in messages])
    elif url == COMPLETIONS_URL:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            what = "no prompt" if prompt is None else f"prompt is {type(prompt).__name__}"
            raise LineError(
                f"{what}; a {COMPLETIONS_URL} body needs a prompt string "
                "(lists of prompts and token ids are not supported)"
            )
        record["prompt"] = prompt
    else:
        raise LineError(f"url {url!r} is not {CHAT_URL} or {COMPLETIONS_URL}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    record["max_new_tokens"] = _int(max_tokens, "max_tokens", minimum=1)
    record["temperature"] = _number(body.get("temperature"), "temperature")
    record["top_p"] = _number(body.get("top_p"), "top_p")
    record["seed"] = _int(body.get("seed"), "seed")
    record["n"] = _int(body.get("n"), "n", minimum=1, maximum=MAX_N)
    record["stop"] = _stop(body.get("stop"))
    record["logprobs"] = _logprobs(body.get("logprobs"), url)
    record["json_schema"] = _json_schema(body.get("response_format"))
    model = body.get("model")
    record["model"] = model if isinstance(model, str) else None


def _message(m: Any) -> Any:
    """A chat message with `content` given as a list of text parts ([{"type": "text", "text":
    ...}], as OpenAI accepts) made one string, the parts joined by newlines (as vLLM does), so
    any chat template renders it. Other part types (images, audio) are refused."""
    content = m.get("content") if isinstance(m, dict) else None
    if not isinstance(content, list):
        return m  # anything else is checked where the prompt is rendered
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise LineError(
                f"a message content part of type {kind!r}; only text parts "
                '({"type": "text", "text": ...}) are supported'
            )
        texts.append(part["text"])
    return {**m, "content": "\n".join(texts)}


def _int(v: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise LineError(f"{name} is {v!r}, not an integer")
    if minimum is not None and v < minimum:
        raise LineError(f"{name} is {v}, below {minimum}")
    if maximum is not None and v > maximum:
        raise LineError(f"{name} is {v}, above {maximum} (OpenAI's limit)")
    return v


def _number(v: Any, name: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise LineError(f"{name} is {v!r}, not a number")
    return float(v)


def _stop(v: Any) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise LineError(f"stop is {v!r}, not a string or a list of strings")


def _logprobs(v: Any, url: str) -> bool | None:
    """Whether logprobs were asked for: chat says true/false, completions a count (0 or more)."""
    if v is None:
        return None
    if isinstance(v, bool):  # chat's form; a completion's `false` means none too
        return v
    if url == CHAT_URL:
        raise LineError(f"logprobs is {v!r}, not true or false")
    return _int(v, "logprobs", minimum=0) is not None


def _json_schema(v: Any) -> str | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise LineError("response_format json_schema has no json_schema.schema object")
        return json.dumps(schema)
    raise LineError(f"response_format {v!r} is not of type text, json_object or json_schema")


class OpenAIBatchTable:
    """Every line of one or more request files, parsed: `table` in input order.

    A malformed line without a custom_id of its own gets `line-N`; where a real line already
    has that custom_id, it gets `line-N~2` (or the next free number), so no real id is lost
    and the error line still names its line."""

    def __init__(self, files: Sequence[str]) -> None:
        self.unsupported_fields: Counter[str] = Counter()
        records: list[dict[str, Any]] = []
        made_up: list[int] = []  # positions in records of the made-up custom_ids
        first_line: dict[str, str] = {}  # a real custom_id -> where it first appeared
        for file in files:
            # Malformed lines' ids name the file too where the input has several.
            name = os.path.basename(file) if len(files) > 1 else None
            for record, generated in self._parse_file(file, name, first_line):
                if generated:
                    made_up.append(len(records))
                records.append(record)
        taken = set(first_line)
        for i in made_up:
            cid = base = records[i]["custom_id"]
            k = 1
            while cid in taken:
                k += 1
                cid = f"{base}~{k}"
            records[i]["custom_id"] = cid
            taken.add(cid)
        batches = [
            pa.RecordBatch.from_pylist(records[i : i + _PARSE_ROWS], schema=SCHEMA)
            for i in range(0, len(records), _PARSE_ROWS)
        ]
        self.table = pa.Table.from_batches(batches, schema=SCHEMA)

    def _parse_file(
        self, file: str, name: str | None, first_line: dict[str, str]
    ) -> Iterator[tuple[dict[str, Any], bool]]:
        try:
            # utf-8-sig: a byte order mark before the first line is not part of its JSON
            with open(file, encoding="utf-8-sig") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    record, unsupported, generated = _parse_line(line, lineno, name)
                    self.unsupported_fields.update(unsupported)
                    cid = record["custom_id"]
                    if not generated:
                        where = f"{file} line {lineno}"
                        if cid in first_line:
                            raise InputError(
                                f"custom_id {cid!r} appears on {first_line[cid]} and {where}; "
                                "each request of a batch file needs its own custom_id"
                            )
                        first_line[cid] = where
                    yield record, generated
        except UnicodeDecodeError as e:
            raise InputError(f"OpenAI batch file {file} is not UTF-8: {e}") from e
