"""The Python API's inputs made token ids and checked before anything runs: prompts (text,
token ids, vLLM's {"prompt": ...} dicts) and the candidates `candidate_logprobs` scores. A
prompt that cannot run raises `RequestError` naming it and the fix, as vLLM raises, rather than
coming back as an empty result; nothing of the call reaches the engine then."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.data.prompts import PromptBuilder
from batchgen.errors import ConfigError, RequestError, RowError

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or vLLM's {"prompt": ...} form
Message = dict[str, Any]  # {"role": ..., "content": ...}


def is_token_ids(x: Any) -> bool:
    """A prompt given as token ids (the API's generate takes text, ids or dicts)?"""
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, ids, a dict) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str | dict) or is_token_ids(prompts):
        return [prompts]
    return list(prompts)


@dataclass(frozen=True, slots=True)
class PromptChecker:
    """Prompts and candidates as token ids, checked against the model: its vocabulary and
    max_model_len (prompt and at least one generated token, or prompt and candidate)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int

    @classmethod
    def of(cls, tokenizer: Any, cfg: Any, max_model_len: int | None) -> PromptChecker:
        """cfg: the model's ModelConfig; max_model_len: the caller's (None: its positions)."""
        positions = cfg.max_position_embeddings
        if max_model_len is not None and max_model_len > positions:
            raise ConfigError(
                f"max_model_len {max_model_len} is more than the model's {positions} positions"
            )
        return cls(tokenizer, cfg.vocab_size, max_model_len or positions)

    def prompt(self, i: int, p: Prompt) -> tuple[str | None, list[int]]:
        """Prompt i's text (None: given as ids) and token ids."""
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if isinstance(p, str):
            ids = self.text_ids(f"prompt {i}", p, special=True)
        elif isinstance(p, list | tuple):
            ids = self.ids(f"prompt {i}", list(p))
        else:
            raise RequestError(
                f"prompt {i} is {type(p).__name__}; pass text, a list of token ids or "
                '{"prompt": text}'
            )
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt {i} ({len(ids)} tokens) leaves no room to generate within the "
                f"maximum model length of {self.max_model_len}; shorten it (or raise "
                "max_model_len, up to the model's positions)"
            )
        return (p if isinstance(p, str) else None), ids

    def text_ids(self, what: str, text: str, special: bool) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, which no tokenizer takes
            raise RequestError(
                f"{what} is not valid Unicode text ({e.reason} at character {e.start})"
            ) from None
        ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        return self.ids(what, ids)

    def ids(self, what: str, ids: list[Any]) -> list[int]:
        if not ids:
            raise RequestError(f"{what} is empty (zero tokens); give it some text or ids")
        vocab = self.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(
                f"{what}: token id {bad!r} is not in the model's vocabulary (0 to {vocab - 1})"
            )
        return ids

    def candidates(self, i: int, prompt_len: int, cands: Any) -> tuple[tuple[int, ...], ...]:
        """Prompt i's candidates (texts, tokenized without special tokens, or id lists)."""
        if isinstance(cands, str) or is_token_ids(cands):
            cands = [cands]
        cands = list(cands)
        if not cands:
            raise RequestError(f"prompt {i} has no candidates to score; give at least one")
        out = []
        for j, c in enumerate(cands):
            what = f"candidate {j} of prompt {i}"
            ids = self.text_ids(what, c, False) if isinstance(c, str) else self.ids(what, c)
            if prompt_len + len(ids) > self.max_model_len:
                raise RequestError(
                    f"prompt {i} ({prompt_len} tokens) + {what} ({len(ids)}) exceeds the "
                    f"maximum model length of {self.max_model_len}"
                )
            out.append(tuple(ids))
        return tuple(out)


def is_candidate_list(x: Any) -> bool:
    """One list of candidates (texts or id lists), rather than one list per prompt?"""
    return isinstance(x, str) or all(
        isinstance(c, str) or (isinstance(c, list) and all(isinstance(t, int) for t in c))
        for c in x
    )


def chat_texts(
    tokenizer: Any,
    messages: Sequence[Message] | Sequence[Sequence[Message]],
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[str]:
    """One conversation (a list of {role, content} messages), or each of a list of them,
    rendered through the tokenizer's chat template (or chat_template, a Jinja text) as
    `--messages-column` renders rows; template_kwargs (add_generation_prompt, ...) go to it."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "this model's tokenizer has no chat template; pass chat_template=, or render "
            "the prompt yourself and call generate()"
        )
    convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    render = functools.partial(
        tokenizer.apply_chat_template,
        tokenize=False,
        chat_template=chat_template,
        **template_kwargs,
    )
    builder = PromptBuilder(None, "messages", None, render)
    try:
        return [builder.render({"messages": list(c)}) for c in convs]
    except RowError as e:
        raise RequestError(str(e)) from None
