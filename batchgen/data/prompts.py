"""Turn one input row into one prompt string.

Three modes, picked by the arguments: a Jinja `template` over the row's columns, a
`messages_column` of chat messages, or (default) a plain `prompt_column`. A row that cannot
become a prompt raises RowError, which the job records for that row; a bad setup (a template
that does not compile, messages mode without a chat template) raises InputError up front.

A template is code run on every row, so its render is bounded in size, steps and time
(render_bounds.py); past a bound the row gets an error record, as for any other template failure.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jinja2
from jinja2 import meta

from batchgen.data.render_bounds import (
    MAX_PROMPT_CHARS,
    BoundedEnvironment,
    Budget,
    RenderLimit,
    bound_template,
)
from batchgen.errors import InputError, RowError

ChatTemplateFn = Callable[[list[dict[str, Any]]], str]


class PromptBuilder:
    """Renders rows into prompts.

    chat_template_fn turns a list of {role, content} messages into the model's prompt text
    (e.g. a tokenizer's apply_chat_template), in messages mode only, where it is required.
    """

    def __init__(
        self,
        prompt_column: str | None = "prompt",
        messages_column: str | None = None,
        template: str | None = None,
        chat_template_fn: ChatTemplateFn | None = None,
    ) -> None:
        if template is not None and messages_column is not None:
            raise InputError("pass either a prompt template or a messages column, not both")
        if template is None and messages_column is None and prompt_column is None:
            raise InputError(
                "no prompt source: pass a prompt column, a messages column or a template"
            )
        if messages_column is not None and chat_template_fn is None:
            raise InputError(
                f"messages column {messages_column!r} needs a chat template; "
                "use a model whose tokenizer has one"
            )
        if messages_column is None and chat_template_fn is not None:
            raise InputError("a chat template applies to a messages column only")
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self.template = template
        self.chat_template_fn = chat_template_fn
        self._template: jinja2.Template | None = None
        self._template_vars: frozenset[str] = frozenset()
        self._budget = Budget()
        if template is not None:
            # Sandboxed: templates come from the command line and see only the row's columns.
            # StrictUndefined: a misspelt or missing column is an error, not an empty string.
            env = BoundedEnvironment(
                self._budget,
                undefined=jinja2.StrictUndefined,
                keep_trailing_newline=True,
                autoescape=False,
            )
            try:
                self._template_vars = frozenset(meta.find_undeclared_variables(env.parse(template)))
                self._template = env.from_string(bound_template(env.parse(template)))
            except jinja2.TemplateSyntaxError as e:
                raise InputError(f"prompt template does not compile: {e} (line {e.lineno})") from e

    def required_columns(self) -> set[str]:
        if self._template is not None:
            return set(self._template_vars)
        if self.messages_column is not None:
            return {self.messages_column}
        assert self.prompt_column is not None
        return {self.prompt_column}

    def missing_fixes(self, available: list[str]) -> dict[str, str]:
        """{column: how to do without it}: the plain prompt column's (another column, or a
        template that builds the prompt from them), for an input that lacks it."""
        if self._template is not None or self.messages_column is not None:
            return {}
        example = "text" if "text" in available else (available[0] if available else "COLUMN")
        return {
            str(self.prompt_column): f"pass --prompt-column {example} (the column holding the "
            f"prompts), or build them with a --template, e.g. --template '{{{{ {example} }}}}'"
        }

    def render(self, row: dict[str, Any]) -> str:
        if self.messages_column is not None:
            return self._apply_chat(_messages(row, self.messages_column))
        return self._render_template(row) if self._template is not None else self._plain(row)

    def _plain(self, row: dict[str, Any]) -> str:
        assert self.prompt_column is not None
        value = _get(row, self.prompt_column)
        if value is None:
            raise RowError(f"prompt column {self.prompt_column!r} is null")
        if not isinstance(value, str):
            raise RowError(
                f"prompt column {self.prompt_column!r} holds {type(value).__name__}, not a string"
            )
        if not value.strip():
            raise RowError(f"prompt column {self.prompt_column!r} is empty")
        return value

    def _render_template(self, row: dict[str, Any]) -> str:
        assert self._template is not None
        # Null columns are left undefined, so `{{ x }}` fails for them while
        # `{% if x is defined %}` and `{{ x | default('') }}` still work.
        context = {k: v for k, v in row.items() if v is not None}
        try:
            text = self._render_bounded(context)
        except RenderLimit as e:
            raise RowError(
                f"{e}; simplify the template (a row's render is bounded in size, steps and time)"
            ) from None
        except jinja2.UndefinedError as e:
            nulls = sorted(k for k in self._template_vars if k in row and row[k] is None)
            if nulls:
                raise RowError(f"null value in column(s) {', '.join(nulls)}: {e}") from e
            raise RowError(f"template render failed: {e}") from e
        except Exception as e:  # any other template-time failure belongs to this row only
            raise RowError(f"template render failed: {type(e).__name__}: {e}") from e
        if not text.strip():
            raise RowError("template rendered an empty prompt")
        return text

    def _render_bounded(self, context: dict[str, Any]) -> str:
        assert self._template is not None
        self._budget.start()
        chunks, size = [], 0
        for chunk in self._template.generate(context):
            size += len(chunk)
            if size > MAX_PROMPT_CHARS:
                raise RenderLimit(f"template rendered over {MAX_PROMPT_CHARS} characters")
            chunks.append(chunk)
            self._budget.check_time()
        return "".join(chunks)

    def _apply_chat(self, messages: list[dict[str, Any]]) -> str:
        assert self.chat_template_fn is not None
        try:
            text = self.chat_template_fn(messages)
        except Exception as e:  # e.g. a template that rejects this row's role order
            raise RowError(f"chat template failed: {type(e).__name__}: {e}") from e
        if not isinstance(text, str) or not text.strip():
            raise RowError("chat template produced an empty prompt")
        return text


def _get(row: dict[str, Any], column: str) -> Any:
    if column not in row:
        raise RowError(f"row has no column {column!r}")
    return row[column]


def _messages(row: dict[str, Any], column: str) -> list[dict[str, Any]]:
    """The row's messages as a list of {role, content, ...} dicts, checked."""
    value = _get(row, column)
    if value is None:
        raise RowError(f"messages column {column!r} is null")
    if isinstance(value, str):  # messages stored as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(
                f"messages column {column!r} holds a string that is not JSON: {e}"
            ) from e
    if not isinstance(value, list) or not value:
        raise RowError(f"messages column {column!r} must be a non-empty list of messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(
                f"message {i} is {type(m).__name__}, not an object with role and content"
            )
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise RowError(f"message {i} has no string 'role'")
        if not isinstance(content, str):
            raise RowError(f"message {i} has no string 'content'")
        # Struct columns give every message every field; drop the nulls so templates see absent
        # keys.
        messages.append({k: v for k, v in m.items() if v is not None})
    return messages
