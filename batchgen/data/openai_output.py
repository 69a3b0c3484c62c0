"""OpenAI batch output lines (`--output-format openai`): OUTPUT/results.jsonl.

One line per request with a result, in the input's order, as OpenAI's Batch API and
`vllm run-batch` write them: `id`, `custom_id`, `response` (`status_code`, `request_id`, and a
`chat.completion` or `text_completion` body with `choices` and `usage`) and `error`. A row that
failed gets status 400, no body, and `error` {code, message}. The ids are the request's place in
the input, so a rerun writes the same ids. Where the results hold several samples of a request
(a `sample_index` column), they are its choices, in sample order.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa

from batchgen.data.atomic import write_atomic
from batchgen.data.writer import RESULTS_FILE

_RESULT_COLUMNS = (
    "custom_id",
    "text",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
)


def write_results(
    directory: str, requests: pa.Table, results: pa.Table, model: str, created: int | None = None
) -> int:
    """Write directory/results.jsonl atomically; returns the number of lines.

    requests: the OpenAI source's table (`custom_id`, `messages`, in input order); results: the
    job's output rows (any order), whose id column is custom_id, the input's."""
    created = int(time.time()) if created is None else created
    # sample_index: several results of one request (n samples), where the job has it.
    columns = [c for c in (*_RESULT_COLUMNS, "sample_index") if c in results.schema.names]
    by_id: dict[Any, list[dict[str, Any]]] = {}
    for r in results.select(columns).to_pylist():
        by_id.setdefault(r["custom_id"], []).append(r)
    ids = requests.column("custom_id").to_pylist()
    chats = requests.column("messages").is_valid().to_pylist()
    lines = [
        json.dumps(output_line(i, cid, chat, by_id[cid], model, created))
        for i, (cid, chat) in enumerate(zip(ids, chats, strict=True))
        if cid in by_id
    ]
    data = "".join(line + "\n" for line in lines).encode()
    write_atomic(directory, RESULTS_FILE, lambda f: f.write(data))
    return len(lines)


def output_line(
    index: int, custom_id: str, chat: bool, rows: list[dict[str, Any]], model: str, created: int
) -> dict[str, Any]:
    """The output line of request `index` of the input, from its result rows (one a sample).
    A request with any failed sample failed."""
    rows = sorted(rows, key=lambda r: r.get("sample_index") or 0)
    request_id = f"batchgen-req-{index}"
    line: dict[str, Any] = {"id": f"batchgen-{index}", "custom_id": custom_id}
    failed = next((r for r in rows if r["error"] is not None), None)
    if failed is not None:
        line["response"] = {"status_code": 400, "request_id": request_id, "body": None}
        line["error"] = {"code": "invalid_request", "message": failed["error"]}
        return line
    choices = []
    for i, row in enumerate(rows):
        if chat:
            choice = {"index": i, "message": {"role": "assistant", "content": row["text"]}}
        else:
            choice = {"index": i, "text": row["text"]}
        choices.append({**choice, "logprobs": None, "finish_reason": row["finish_reason"]})
    kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    body: dict[str, Any] = {"id": f"{kind[0]}-{index}", "object": kind[1]}
    # The samples share one prompt: it counts once.
    prompt = rows[0]["prompt_tokens"]
    completion = sum(r["completion_tokens"] for r in rows)
    body.update(
        created=created,
        model=model,
        choices=choices,
        usage={
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    )
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    line["error"] = None
    return line
