"""OpenAI batch output lines (`--output-format openai`): OUTPUT/.batchgen/results.jsonl.

One line per request with a result, in the input's order, as OpenAI's Batch API and
`vllm run-batch` write them: `id`, `custom_id`, `response` (`status_code`, `request_id`, and a
`chat.completion` or `text_completion` body with `choices` and `usage`) and `error`. A row that
failed (finish_reason error) gets status 400, no body, and `error` {code, message}; one cut at
max_tokens is a 200 with finish_reason "length", as OpenAI's. The ids are the request's place in
the input, so a rerun writes the same ids. Where the results hold several samples of a request
(a `sample_index` column), they are its choices, in sample order. A request that asked for
`logprobs` gets each generated token's: a chat choice's `logprobs.content` ({token, logprob,
bytes, top_logprobs}), a completion's `tokens`/`token_logprobs`/`text_offset`/`top_logprobs`,
without the EOS token that ended it (it is not in the text either). `top_logprobs` holds each
token's likeliest alternatives where the request asked for some (the parts' `top_logprobs`
column), else `[]` (chat) or null (completion). The body's `model` is the request's own where
it named one, else the local model's path. A task embed job's lines (/v1/embeddings) get an
embeddings response: `{"object": "list", "data": [{"object": "embedding", "index": 0,
"embedding": [...]}], "model", "usage": {"prompt_tokens", "total_tokens"}}`; a line's
`dimensions` cuts the job's embedding to its first N values and normalizes it again where the
job normalized (the embedding field's metadata says), as `--dimensions N` would have made it;
`encoding_format` base64 writes it as OpenAI does: its little-endian float32 bytes, base64.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.data.pooled_columns import NORMALIZED_KEY, finish_embedding
from batchgen.data.records import TEXT_COLUMN
from batchgen.data.writer import RESULTS_FILE, write_file

_RESULT_COLUMNS = (
    "custom_id",
    TEXT_COLUMN,
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
)


TokenText = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class EmbeddingShape:
    """How an embeddings line wants its vector: cut to `dimensions` (None: as the job made
    it), normalized again after the cut where the job normalized, written as float or base64."""

    dimensions: int | None = None
    encoding: str = "float"
    normalized: bool = False

    def encode(self, embedding: list[float]) -> list[float] | str:
        v = np.asarray(embedding, dtype=np.float32)
        if self.dimensions is not None:
            v = finish_embedding(v, self.dimensions, self.normalized)
        if self.encoding == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()


def write_results(
    directory: str,
    requests: pa.Table,
    results: pa.Table,
    model: str,
    token_text: TokenText = str,
    created: int | None = None,
    eos_ids: Collection[int] = (),
    name: str = RESULTS_FILE,
) -> int:
    """Write directory/name (.batchgen/results.jsonl) atomically; returns the number of lines.

    requests: the OpenAI source's table (`custom_id`, `messages`, `logprobs`, in input order);
    results: the job's output rows (any order), whose id column is custom_id, the input's, with
    `token_ids` and `logprobs` for the requests that ask for logprobs. token_text: a token's
    text; eos_ids: the tokens that end a completion, left out of its logprobs. `model`: the
    body's model of a request whose line named none."""
    created = int(time.time()) if created is None else created
    # sample_index: several results of one request (n samples), where the job has it.
    extra = ("sample_index", "token_ids", "logprobs", "top_logprobs", "embedding")
    columns = [c for c in (*_RESULT_COLUMNS, *extra) if c in results.schema.names]
    by_id: dict[Any, list[dict[str, Any]]] = {}
    for r in results.select(columns).to_pylist():
        by_id.setdefault(r["custom_id"], []).append(r)
    ids = requests.column("custom_id").to_pylist()
    chats = requests.column("messages").is_valid().to_pylist()
    asked = requests.column("logprobs").fill_null(False).to_pylist()
    named = requests.column("model") if "model" in requests.column_names else None
    models = [model] * len(ids) if named is None else named.fill_null(model).to_pylist()
    eos = frozenset(eos_ids)
    shapes = _embedding_shapes(requests, results)
    lines = [
        json.dumps(
            output_line(
                i, cid, chat, by_id[cid], named, created, token_text if lp else None, eos, shape
            )
        )
        for i, (cid, chat, lp, named, shape) in enumerate(
            zip(ids, chats, asked, models, shapes, strict=True)
        )
        if cid in by_id
    ]
    data = "".join(line + "\n" for line in lines).encode()
    write_file(directory, name, lambda f: f.write(data))
    return len(lines)


def output_line(
    index: int,
    custom_id: str,
    chat: bool,
    rows: list[dict[str, Any]],
    model: str,
    created: int,
    token_text: TokenText | None = None,
    eos_ids: Collection[int] = frozenset(),
    shape: EmbeddingShape = EmbeddingShape(),
) -> dict[str, Any]:
    """The output line of request `index` of the input, from its result rows (one a sample).
    A request with any failed sample failed. token_text: the request asked for logprobs."""
    rows = sorted(rows, key=lambda r: r.get("sample_index") or 0)
    request_id = f"batchgen-req-{index}"
    line: dict[str, Any] = {"id": f"batchgen-{index}", "custom_id": custom_id}
    # A constrained (JSON-mode) row cut at max_tokens keeps its text and a note in `error`:
    # OpenAI answers it 200 with finish_reason "length", so only error rows fail.
    failed = next((r for r in rows if r["finish_reason"] == "error"), None)
    if failed is not None:
        line["response"] = {"status_code": 400, "request_id": request_id, "body": None}
        line["error"] = {"code": "invalid_request", "message": failed["error"]}
        return line
    if "embedding" in rows[0]:  # task embed: an embeddings response
        line["response"] = {"status_code": 200, "request_id": request_id}
        line["response"]["body"] = embeddings_body(rows[0], model, shape)
        line["error"] = None
        return line
    choices = []
    for i, row in enumerate(rows):
        if chat:
            choice = {"index": i, "message": {"role": "assistant", "content": row[TEXT_COLUMN]}}
        else:
            choice = {"index": i, "text": row[TEXT_COLUMN]}
        logprobs = _logprobs(row, chat, token_text, eos_ids) if token_text is not None else None
        choices.append({**choice, "logprobs": logprobs, "finish_reason": row["finish_reason"]})
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


def _embedding_shapes(requests: pa.Table, results: pa.Table) -> list[EmbeddingShape]:
    """Each request's EmbeddingShape (the default for a line that sets neither field)."""
    n, names = requests.num_rows, requests.column_names
    dims = requests.column("dimensions").to_pylist() if "dimensions" in names else [None] * n
    fmts = requests.column("encoding_format") if "encoding_format" in names else None
    fmts = [None] * n if fmts is None else fmts.to_pylist()
    field = results.schema.field("embedding") if "embedding" in results.schema.names else None
    normalized = field is not None and (field.metadata or {}).get(NORMALIZED_KEY) == b"true"
    return [EmbeddingShape(d, f or "float", normalized) for d, f in zip(dims, fmts, strict=True)]


def embeddings_body(
    row: dict[str, Any], model: str, shape: EmbeddingShape = EmbeddingShape()
) -> dict[str, Any]:
    """A /v1/embeddings response body, OpenAI's shape, for one input."""
    data = [{"object": "embedding", "index": 0, "embedding": shape.encode(row["embedding"])}]
    n = row["prompt_tokens"]
    usage = {"prompt_tokens": n, "total_tokens": n}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _logprobs(
    row: dict[str, Any], chat: bool, token_text: TokenText, eos_ids: Collection[int]
) -> dict[str, Any]:
    """A choice's logprobs in the format of its endpoint."""
    ids, logprobs, top = row["token_ids"], row["logprobs"], row.get("top_logprobs")
    if ids and ids[-1] in eos_ids and row["finish_reason"] == "stop":  # not part of the text
        ids, logprobs, top = ids[:-1], logprobs[:-1], top and top[:-1]
    texts = [token_text(t) for t in ids]
    # per token: its alternatives as (text, logprob), best first; None where none were asked
    alts = [[(token_text(a["id"]), a["logprob"]) for a in t] for t in top] if top else None
    if chat:
        return {
            "content": [
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": a, "logprob": v, "bytes": list(a.encode())}
                        for a, v in (alts[i] if alts else ())
                    ],
                }
                for i, (s, lp) in enumerate(zip(texts, logprobs, strict=True))
            ]
        }
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": [dict(a) for a in alts] if alts else None,
        "text_offset": offsets,
    }
