"""Which of a run's options combine: the rules across fields (a task's options, one constraint
kind, shards or workers, the OpenAI output's limits), checked after each field on its own
(job/config.py); ConfigError naming what to drop."""

from __future__ import annotations

from typing import Any, Protocol

from batchgen.choices import OutputFormat, Task
from batchgen.engine.params import MAX_TOP_LOGPROBS
from batchgen.errors import ConfigError


class RunOptions(Protocol):
    """The RunConfig fields these rules read (RunConfig imports this module, so not it)."""

    task: Task
    choice: list[str] | None
    regex: str | None
    json_schema: str | None
    prompt_logprobs: int
    pooling: Any
    normalize: bool | None
    dimensions: int | None
    embedding_dtype: Any
    n: int
    n_as_list: bool
    output_format: OutputFormat
    messages_column: str | None
    template: str | None
    shard: Any
    workers: int | str


def check_combinations(cfg: RunOptions) -> None:
    """ConfigError for options that contradict each other or mean nothing together."""
    given = [k for k in ("choice", "regex", "json_schema") if getattr(cfg, k) is not None]
    if len(given) > 1:
        raise ConfigError(f"use one of choice, regex and json_schema, not {' and '.join(given)}")
    if cfg.task is Task.SCORE:
        _check_score(cfg)
    if cfg.task is Task.PROMPT_LOGPROBS:
        _check_prompt_logprobs(cfg)
    elif cfg.prompt_logprobs:
        raise ConfigError(
            "prompt_logprobs keeps each prompt token's alternatives in a prompt-logprobs "
            "job; add --task prompt-logprobs (or drop --prompt-logprobs)"
        )
    _check_pooled(cfg)
    if cfg.n_as_list and cfg.output_format is OutputFormat.OPENAI:
        raise ConfigError(
            "n_as_list: the OpenAI output already gathers a request's samples as its "
            "choices; drop --n-as-list"
        )
    if cfg.messages_column and cfg.template:
        raise ConfigError("use either messages_column or template, not both")
    if cfg.output_format is OutputFormat.OPENAI and (cfg.shard or cfg.workers != 1):
        raise ConfigError(
            "output_format openai writes one .batchgen/results.jsonl per job; run it without "
            "shard and workers"
        )


def _check_score(cfg: RunOptions) -> None:
    """Options that mean nothing when labels are scored, not sampled."""
    if cfg.regex is not None or cfg.json_schema is not None:
        raise ConfigError("task score scores --choice labels; drop --regex / --json-schema")
    if cfg.n != 1 or cfg.n_as_list:
        raise ConfigError("task score samples nothing; drop --n / --n-as-list")
    if cfg.output_format is OutputFormat.OPENAI:
        raise ConfigError(
            "task score writes scores, not OpenAI completions; drop --output-format openai"
        )
    if cfg.choice is not None and any(not str(c).strip() for c in cfg.choice):
        raise ConfigError(
            f"task score: --choice {cfg.choice!r} has an empty label, which would score "
            'no tokens; give each label some text (" positive" keeps its space)'
        )


def _check_prompt_logprobs(cfg: RunOptions) -> None:
    """Options that mean nothing when the prompt is scored and nothing is sampled."""
    what = "task prompt-logprobs scores the prompt and samples nothing"
    if any(getattr(cfg, k) is not None for k in ("choice", "regex", "json_schema")):
        raise ConfigError(f"{what}; drop --choice / --regex / --json-schema")
    if cfg.n != 1 or cfg.n_as_list:
        raise ConfigError(f"{what}; drop --n / --n-as-list")
    if cfg.output_format is OutputFormat.OPENAI:
        raise ConfigError(f"{what}; drop --output-format openai")
    if not 0 <= cfg.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise ConfigError(
            f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {cfg.prompt_logprobs}"
        )


_EMBED_OPTIONS = {"pooling": "auto", "normalize": None, "dimensions": None}
_EMBED_OPTIONS["embedding_dtype"] = "float32"


def _check_pooled(cfg: RunOptions) -> None:
    """Task embed's options in an embed job only; nothing sampled in embed and classify."""
    if cfg.task is not Task.EMBED:
        given = [k for k, off in _EMBED_OPTIONS.items() if getattr(cfg, k) != off]
        if given:
            flags = " / ".join(f"--{k.replace('_', '-')}" for k in given)
            raise ConfigError(f"{flags} shape embeddings: add --task embed (or drop them)")
    if not cfg.task.pooled:
        return
    what = f"task {cfg.task.value} pools the prompt and samples nothing"
    if any(getattr(cfg, k) is not None for k in ("choice", "regex", "json_schema")):
        raise ConfigError(f"{what}; drop --choice / --regex / --json-schema")
    if cfg.n != 1 or cfg.n_as_list:
        raise ConfigError(f"{what}; drop --n / --n-as-list")
    if cfg.task is Task.CLASSIFY and cfg.output_format is OutputFormat.OPENAI:
        raise ConfigError(f"{what}; OpenAI batch output has no classify endpoint")
    if cfg.dimensions is not None and cfg.dimensions < 1:
        raise ConfigError(f"dimensions must be >= 1, got {cfg.dimensions}")
