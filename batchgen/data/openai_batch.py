"""OpenAI batch request files (the lines `vllm run-batch` reads) as an input.

A .jsonl file whose first non-blank line is an object with `custom_id` and `body` is one: each
line is a POST to `/v1/chat/completions` (body.messages) or `/v1/completions` (body.prompt).
Each line becomes one row of the columns the pipeline already uses: `custom_id` (the row id),
`prompt` or `messages` (JSON text, rendered with the chat template), the per-row overrides
`max_new_tokens`, `temperature`, `top_p`, `seed`, `stop`, the penalties (`presence_penalty`,
`frequency_penalty`, vLLM's `repetition_penalty`, `logit_bias`), and `n`, `logprobs`, `json_schema`.

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

from batchgen.data.openai_body import LineError, parse_body
from batchgen.errors import InputError

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
        ("top_logprobs", pa.int64()),  # alternatives per generated token (logprobs asked)
        ("json_schema", pa.string()),  # JSON text of the schema to follow
        ("presence_penalty", pa.float64()),
        ("frequency_penalty", pa.float64()),
        ("repetition_penalty", pa.float64()),  # vLLM's extra parameter
        ("logit_bias", pa.string()),  # the body's {"token id": bias} as JSON text
        ("model", pa.string()),  # the body's model, echoed in the output lines
        ("embeddings", pa.bool_()),  # a /v1/embeddings line (task embed)
        ("dimensions", pa.int64()),  # an embeddings line's Matryoshka size
        ("encoding_format", pa.string()),  # an embeddings line's: float or base64
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
        "top_logprobs",
        "response_format",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "input",  # /v1/embeddings
        "encoding_format",
        "dimensions",
    }
)
_PARSE_ROWS = 4096  # lines per Arrow batch while parsing


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
        parse_body(obj.get("url"), body, record)
    except LineError as e:
        record = {**dict.fromkeys(SCHEMA.names), "custom_id": record["custom_id"]}
        where = f"{file} line {lineno}" if file else f"line {lineno}"
        record[OPENAI_ERROR_COLUMN] = f"OpenAI batch {where}: {e}"
    return record, unsupported, generated


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
