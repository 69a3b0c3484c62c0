"""A row's generation options: the job's (flags or spec), overridden by the row's own columns.

Sampling values (`max_new_tokens`, `temperature`, `top_p`, `seed` columns), stop strings (a
`stop` column), a constraint (`choice` / `regex` / `json_schema` columns) and, for a score
job, the labels to score (a `choice` column, else the job's `--choice`).

Choice labels meet the prompt at a word boundary: where a row's prompt does not end in
whitespace, a label written with no leading whitespace also matches (and is scored as) its
space-prefixed form, which is how BPE tokenizers write a word after "Sentiment:"; the output
keeps the label as written (engine/constraints.py, `word_boundary`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection
from typing import Any

from batchgen.engine.constraints import ConstraintError, parse_choices, word_boundary
from batchgen.engine.params import logit_bias_pairs
from batchgen.engine.sequence import Constraint, ConstraintKind, DecodeParams
from batchgen.errors import ConfigError, RowError
from batchgen.job.bias_column import BIAS_COLUMN
from batchgen.job.config import RunConfig, Task, read_json_schema
from batchgen.job.seeds import row_seed
from batchgen.job.tokenization import tokenize

# Optional input columns that override the job's sampling defaults for their row. Without a
# seed column, each row's seed is derived from the job's seed and the row's id (seeds.py).
# top_logprobs: keep each generated token's N likeliest alternatives (a top_logprobs column).
OVERRIDE_COLUMNS = (
    *("max_new_tokens", "temperature", "top_p", "seed", "top_logprobs", "min_tokens", "min_p"),
    *("repetition_penalty", "presence_penalty", "frequency_penalty"),
)
_INTEGERS = ("max_new_tokens", "seed", "top_logprobs", "min_tokens")
# Optional input columns that constrain their row's output (over the job's --choice etc.).
CONSTRAINT_COLUMNS = tuple(k.value for k in ConstraintKind)
# An optional input column of stop strings (a string or a list) that replaces --stop for its row.
STOP_COLUMN = "stop"
# One of token ids (a list of integers) that replaces --stop-token-id for its row.
STOP_IDS_COLUMN = "stop_token_ids"
# BIAS_COLUMN: {token id: bias} (a map, or its JSON text; a struct is compacted to that,
# bias_column.py) that replaces --logit-bias.

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]  # labels and their token ids


def warn_option_columns(columns: Collection[str]) -> None:
    """Log once which input columns act as per-row options: a data column that happens to be
    named `choice`, `stop` or `n` would otherwise change its rows' outputs silently."""
    named = (STOP_COLUMN, STOP_IDS_COLUMN, BIAS_COLUMN, "n")
    used = [c for c in (*OVERRIDE_COLUMNS, *CONSTRAINT_COLUMNS, *named) if c in columns]
    if used:
        log.warning(
            "input column(s) %s set their rows' options (docs/jobs.md, per-row columns); "
            "rename any that are plain data",
            ", ".join(map(repr, used)),
        )


def job_constraint(cfg: RunConfig) -> Constraint | None:
    """The job's --choice / --regex / --json-schema, or None (a score job's labels are
    scored, not a constraint)."""
    if cfg.task is Task.SCORE:
        return None
    if cfg.choice is not None:
        try:
            return Constraint(ConstraintKind.CHOICE, parse_choices(cfg.choice))
        except ConstraintError as e:
            raise ConfigError(str(e)) from None
    if cfg.regex is not None:
        return Constraint(ConstraintKind.REGEX, cfg.regex)
    if cfg.json_schema is not None:
        schema = read_json_schema(cfg.json_schema)
        return Constraint(ConstraintKind.JSON_SCHEMA, schema, cfg.json_any_whitespace)
    return None


def row_constraint(
    rec: dict[str, Any], columns: list[str], any_whitespace: bool = False
) -> Constraint | None:
    """A row's own constraint from its choice / regex / json_schema column, or None."""
    given = [c for c in columns if rec.get(c) is not None]
    if len(given) > 1:
        raise RowError(f"the row sets both {given[0]} and {given[1]}; give one constraint")
    if not given:
        return None
    col, value = given[0], rec[given[0]]
    kind = ConstraintKind(col)
    try:
        if kind is ConstraintKind.CHOICE:
            return Constraint(kind, parse_choices(value))
        if isinstance(value, dict):  # a struct column: the schema itself
            import json

            value = json.dumps(value)
        if not isinstance(value, str):
            raise ConstraintError(f"{col} is {type(value).__name__}, not text")
        return Constraint(kind, value, any_whitespace and kind is ConstraintKind.JSON_SCHEMA)
    except ConstraintError as e:
        raise RowError(str(e)) from e


class RowOptions:
    """The options of the rows of one input: `params(rec)` gives a row's DecodeParams,
    `labels(rec)` a score row's labels."""

    def __init__(self, cfg: RunConfig, columns: Collection[str], tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.overrides = [c for c in OVERRIDE_COLUMNS if c in columns]
        self.constraint_columns = [c for c in CONSTRAINT_COLUMNS if c in columns]
        self.stop_column = STOP_COLUMN if STOP_COLUMN in columns else None
        self.stop_ids_column = STOP_IDS_COLUMN if STOP_IDS_COLUMN in columns else None
        self.bias_column = BIAS_COLUMN if BIAS_COLUMN in columns else None
        self.score = cfg.task is Task.SCORE
        if self.score:  # a choice column holds the row's labels to score; nothing constrains
            self.constraint_columns = [c for c in self.constraint_columns if c == "choice"]
            if cfg.choice is None and not self.constraint_columns:
                raise ConfigError(
                    "task score needs labels to score: pass --choice a,b,c or give the input a "
                    "choice column (a list of labels per row)"
                )
            self.job_labels = _parse_labels(cfg.choice) if cfg.choice is not None else ()
            self.job_label_ids = {w: self._label_ids(self.job_labels, w) for w in (False, True)}
        self._warned: set[str] = set()  # the label warnings given (once a job each)
        try:
            self.defaults = self._job_params(cfg)
        except ValueError as e:  # min_tokens over max_new_tokens, min_p out of [0, 1], ...
            raise ConfigError(str(e)) from None
        if cfg.choice is not None:
            self._check_round_trip(_parse_labels(cfg.choice))

    @staticmethod
    def _job_params(cfg: RunConfig) -> DecodeParams:
        return DecodeParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop=tuple(cfg.stop),
            stop_token_ids=tuple(cfg.stop_token_ids),
            min_tokens=cfg.min_tokens,
            min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty,
            presence_penalty=cfg.presence_penalty,
            frequency_penalty=cfg.frequency_penalty,
            logit_bias=tuple(cfg.logit_bias.items()),
            ignore_eos=cfg.ignore_eos,
            constraint=job_constraint(cfg),
            prompt_logprobs=cfg.prompt_logprobs if cfg.task is Task.PROMPT_LOGPROBS else None,
        )

    @property
    def columns(self) -> set[str]:
        """The input columns the options read."""
        named = [self.stop_column, self.stop_ids_column, self.bias_column]
        return {*self.overrides, *self.constraint_columns, *filter(None, named)}

    def params(
        self, rec: dict, row_id: Any, sample: int = 0, prompt_tail: str = ""
    ) -> DecodeParams:
        """Sample `sample` of the row `rec` (of id row_id): the job's options, with the row's.
        prompt_tail: the rendered prompt's last character (a choice's word boundary)."""
        values = {c: rec[c] for c in self.overrides if rec.get(c) is not None}
        try:
            for c, v in values.items():
                values[c] = row_number(c, v, integer=c in _INTEGERS)
            if sample and "seed" in values:  # a row's explicit seed is its sample 0's
                values["seed"] = row_seed(values["seed"], row_id, sample)
            values.setdefault("seed", row_seed(self.cfg.seed, row_id, sample))
            constraint = row_constraint(rec, self.constraint_columns, self.cfg.json_any_whitespace)
            constraint = constraint or self.defaults.constraint
            if constraint is not None and constraint.kind is ConstraintKind.CHOICE:
                self._warn_boundary(constraint.spec, prompt_tail)
                if _after_word(prompt_tail):
                    constraint = word_boundary(constraint)
            if constraint is not self.defaults.constraint:
                values["constraint"] = constraint
            if self.stop_column and rec[self.stop_column] is not None:
                values["stop"] = _stop_strings(rec[self.stop_column])
            if self.stop_ids_column and rec[self.stop_ids_column] is not None:
                ids = rec[self.stop_ids_column]
                if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
                    raise ValueError(f"{STOP_IDS_COLUMN} is {ids!r}, not a list of token ids")
                values["stop_token_ids"] = tuple(row_number(STOP_IDS_COLUMN, t, True) for t in ids)
            if self.bias_column and rec[self.bias_column] is not None:
                values["logit_bias"] = logit_bias_pairs(rec[self.bias_column])
            return dataclasses.replace(self.defaults, **values)
        except (ValueError, TypeError) as e:
            raise RowError(f"bad per-row sampling value: {e}") from e

    def labels(self, rec: dict, prompt_tail: str = "") -> Labels:
        """A score row's labels (its choice column's, else the job's) and their token ids, a
        bare label's after a space where the prompt (ending in prompt_tail) ends in a word."""
        after = _after_word(prompt_tail)
        if rec.get("choice") is None:
            if not self.job_labels:
                raise RowError(
                    "no labels to score: the row's choice is null and there is no --choice"
                )
            self._warn_boundary(self.job_labels, prompt_tail)
            return self.job_labels, self.job_label_ids[after]
        try:
            labels = _parse_labels(rec["choice"])
            self._warn_boundary(labels, prompt_tail)
            return labels, self._label_ids(labels, after)
        except ConfigError as e:
            raise RowError(str(e)) from None

    def _warn_boundary(self, labels: tuple[str, ...], prompt_tail: str) -> None:
        """Warn once a job where labels meet prompts at a boundary a tokenizer splits badly."""
        if prompt_tail == " " and any(not s[:1].isspace() for s in labels):
            self._warn_once(
                "space",
                "prompts end in a space before --choice labels: tokenizers keep a word's "
                "space in its token, so the model seldom writes a label after a lone space; end "
                "the prompt without it (a bare label then matches ' label' too)",
            )
        elif prompt_tail.isspace() and any(s[:1].isspace() for s in labels):
            self._warn_once(
                "double",
                f"prompts end in whitespace and labels {[s for s in labels if s[:1].isspace()]}"
                " start with it too: write the labels without the leading space",
            )

    def _check_round_trip(self, labels: tuple[str, ...]) -> None:
        """Warn about labels the tokenizer cannot write back exactly (unknown characters)."""
        ids = tokenize(self.tokenizer, [" " + s for s in labels], add_special_tokens=False)
        for label, x in zip(labels, ids, strict=True):
            if self.tokenizer.decode(x) != " " + label:
                self._warn_once(
                    f"trip {label}",
                    f"choice: the tokenizer does not write the label {label!r} back exactly "
                    f"(it decodes as {self.tokenizer.decode(x)[1:]!r}); the model cannot write "
                    "it: use characters of its vocabulary",
                )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def _label_ids(
        self, labels: tuple[str, ...], after_word: bool = False
    ) -> tuple[tuple[int, ...], ...]:
        """Each label's tokens as a continuation of the prompt (no special tokens); after a
        word, a bare label's with its space."""
        texts = [" " + s if after_word and not s[:1].isspace() else s for s in labels]
        ids = tokenize(self.tokenizer, texts, add_special_tokens=False)
        for label, x in zip(labels, ids, strict=True):
            if not x:
                raise ConfigError(f"choice: the label {label!r} tokenizes to no tokens")
        return tuple(tuple(x) for x in ids)


def row_number(name: str, v: Any, integer: bool) -> int | float:
    """A row's numeric option: a finite number, and a whole one where an integer is meant
    (max_new_tokens 2.7 is not 2). ValueError naming the value."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{name} is {v!r}, not a number")
    if not math.isfinite(v):
        raise ValueError(f"{name} is {v!r}, not a finite number")
    if integer:
        if v != int(v):
            raise ValueError(f"{name} is {v!r}, not an integer")
        return int(v)
    return float(v)


def _after_word(prompt_tail: str) -> bool:
    """A prompt ending in prompt_tail ends in a word (or punctuation), not in whitespace."""
    return bool(prompt_tail) and not prompt_tail.isspace()


def _parse_labels(value: Any) -> tuple[str, ...]:
    try:
        return parse_choices(value)
    except ConstraintError as e:
        raise ConfigError(str(e)) from None


def _stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ValueError(f"{STOP_COLUMN} is {value!r}, not a string or a list of strings")
