"""OpenAI batch output lines (`--output-format openai`): OUTPUT/results.jsonl.

One line per request with a result, in the input's order, as OpenAI's Batch API and
`vllm run-batch` write them: `id`, `custom_id`, `response` (`status_code`, `request_id`, and a
`chat.completion` or `text_completion` body with `choices` and `usage`) and `error`. A row that
failed gets status 400, no body, and `error` {code, message}. The ids are the request's place in
the input, so a rerun writes the same ids.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa

from batchgen.data.writer import RESULTS_FILE, write_atomic

_RESULT_COLUMNS = ("id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error")


def write_results(
    directory: str, requests: pa.Table, results: pa.Table, model: str, created: int | None = None
) -> int:
    """Write directory/results.jsonl atomically; returns the number of lines.

    requests: the OpenAI source's table (`custom_id`, `messages`, in input order); results: the
    job's output rows (any order)."""
    created = int(time.time()) if created is None else created
    by_id = {r["id"]: r for r in results.select(list(_RESULT_COLUMNS)).to_pylist()}
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
    index: int, custom_id: str, chat: bool, row: dict[str, Any], model: str, created: int
) -> dict[str, Any]:
    """The output line of request `index` of the input, from its result row."""
    request_id = f"batchgen-req-{index}"
    line: dict[str, Any] = {"id": f"batchgen-{index}", "custom_id": custom_id}
    if row["error"] is not None:
        line["response"] = {"status_code": 400, "request_id": request_id, "body": None}
        line["error"] = {"code": "invalid_request", "message": row["error"]}
        return line
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": row["text"]}}
        body = {"id": f"chatcmpl-{index}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": row["text"]}
        body = {"id": f"cmpl-{index}", "object": "text_completion"}
    choice.update(logprobs=None, finish_reason=row["finish_reason"])
    prompt, completion = row["prompt_tokens"], row["completion_tokens"]
    body.update(
        created=created,
        model=model,
        choices=[choice],
        usage={
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    )
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    line["error"] = None
    return line
