"""The body of one OpenAI batch request line -> the row's columns (openai_batch.py's record).

Each mapped field is checked as OpenAI checks it (types, ranges: `n` up to 128, `top_logprobs`
up to 20, a completion's `logprobs` count up to 5); a value that cannot be is a `LineError`,
which makes the line an error line and leaves the job running.
"""

from __future__ import annotations

import json
from typing import Any

from batchgen.choices import MAX_N  # a line asking for more is an error line

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # a job of --task embed: `input`, one string a line
ENCODING_FORMATS = ("float", "base64")  # an embedding's, as OpenAI writes it


class LineError(Exception):
    pass


def parse_body(url: Any, body: dict[str, Any], record: dict[str, Any]) -> None:
    record["embeddings"] = url == EMBEDDINGS_URL
    if url == EMBEDDINGS_URL:
        _embedding_input(body, record)
        return
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
        raise LineError(f"url {url!r} is not {CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    record["max_new_tokens"] = _int(max_tokens, "max_tokens", minimum=1)
    record["temperature"] = _number(body.get("temperature"), "temperature")
    record["top_p"] = _number(body.get("top_p"), "top_p")
    record["seed"] = _int(body.get("seed"), "seed")
    record["n"] = _int(body.get("n"), "n", minimum=1, maximum=MAX_N)
    record["stop"] = _stop(body.get("stop"))
    record["logprobs"] = _logprobs(body.get("logprobs"), url)
    record["top_logprobs"] = _top_logprobs(body, url, record["logprobs"])
    record["json_schema"] = _json_schema(body.get("response_format"))
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        record[name] = _number(body.get(name), name)  # ranges: checked with the row's options
    record["logit_bias"] = _logit_bias(body.get("logit_bias"))
    model = body.get("model")
    record["model"] = model if isinstance(model, str) else None


def _embedding_input(body: dict[str, Any], record: dict[str, Any]) -> None:
    """An embeddings body: one `input` string (a list, OpenAI's several inputs a request, is
    refused: one line is one row here), `dimensions` (1 or more; the job checks it against the
    model's size) and `encoding_format`, float (OpenAI's default) or base64."""
    text = body.get("input")
    if isinstance(text, list):
        raise LineError(
            f"input is a list of {len(text)}; batchgen embeds one input string a line: write "
            "each input as its own line (its own custom_id)"
        )
    if not isinstance(text, str) or not text:
        what = "no input" if text is None else f"input is {type(text).__name__}"
        raise LineError(f"{what}; a {EMBEDDINGS_URL} body needs an input string")
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise LineError(f"encoding_format {fmt!r} is not one of {', '.join(ENCODING_FORMATS)}")
    record["prompt"] = text
    record["dimensions"] = _int(body.get("dimensions"), "dimensions", minimum=1)
    record["encoding_format"] = fmt
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


def _top_logprobs(body: dict[str, Any], url: str, asked: bool | None) -> int | None:
    """The alternatives per token: chat's `top_logprobs` (0-20, with logprobs true), a
    completion's `logprobs` count (0-5)."""
    if url == CHAT_URL:
        n = _int(body.get("top_logprobs"), "top_logprobs", minimum=0, maximum=20)
        if n and not asked:
            raise LineError("top_logprobs needs logprobs: true")
    else:
        v = body.get("logprobs")
        n = None if isinstance(v, bool) else _int(v, "logprobs", minimum=0, maximum=5)
    return n or None


def _logit_bias(v: Any) -> str | None:
    """{"token id": bias} as JSON text (the row's logit_bias column reads it)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise LineError(f'logit_bias is {v!r}, not an object of {{"token id": bias}}')
    return json.dumps(v)


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
