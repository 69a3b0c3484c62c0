"""A row's decoding parameters (`DecodeParams`, the engine's; the Python API's vLLM-shaped
`SamplingParams` in api/sampling.py builds on it) and its output constraint: plain data, no
torch. vLLM's penalties are here as vLLM defines them: `repetition_penalty` over the prompt and
the output, `presence_penalty` / `frequency_penalty` over the output, `logit_bias` added to the
raw logits (engine/penalties.py applies them)."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConstraintKind(str, enum.Enum):
    CHOICE = "choice"  # one of a list of strings
    REGEX = "regex"
    JSON_SCHEMA = "json_schema"  # the JSON text of a schema


@dataclass(slots=True, frozen=True)
class Constraint:
    kind: ConstraintKind
    spec: str | tuple[str, ...]  # the choices (CHOICE) or the pattern / schema text
    any_whitespace: bool = False  # JSON: free whitespace between tokens, not one space after , :

    def describe(self) -> str:
        if self.kind is ConstraintKind.CHOICE:
            return f"--choice {','.join(self.spec)}"
        return f"--{self.kind.value.replace('_', '-')} {str(self.spec)[:60]}"


class Pooling(str, enum.Enum):
    """How a pooled row (task embed / classify) turns its prompt's final hidden states (after
    the final norm) into one vector: nothing is sampled (engine/pooling.py)."""

    LAST = "last"  # the last prompt token's (decoder embedding models: Qwen3-Embedding)
    MEAN = "mean"  # the mean over the prompt's tokens
    CLS = "cls"  # the first token's
    CLASSIFY = "classify"  # the last token's through the checkpoint's classifier head (`score`)

    @property
    def every_token(self) -> bool:
        """Does it read tokens before the last (then no prefix-cache hit may skip them)?"""
        return self in (Pooling.MEAN, Pooling.CLS)


# The most alternatives a generated token reports (`top_logprobs`, OpenAI's bound for chat).
MAX_TOP_LOGPROBS = 20
# OpenAI's range of a logit bias; vLLM clamps a value outside it to its end, and so does this.
MAX_LOGIT_BIAS = 100.0
# The most tokens one logit_bias may hold (OpenAI's bound): a row's map is parsed for each row
# of the read-ahead, and a bigger one is a mistake more often than a need.
MAX_LOGIT_BIAS_TOKENS = 300
# An integer past int64 cannot become a tensor: refused here, not at the first step.
INT64_MAX = 2**63 - 1
LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, by token id


@dataclass(slots=True, frozen=True)
class DecodeParams:
    """The engine's per-row decoding parameters, filled by the command line from its options
    (its defaults: greedy, 64 tokens, seed 0). temperature == 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None  # a choice, regex or JSON schema the output must match
    top_logprobs: int = 0  # each generated token's likeliest alternatives kept (0: none)
    stop_token_ids: tuple[int, ...] = ()  # a sampled one ends the row (kept out of its text)
    min_tokens: int = 0  # no EOS, stop token id or stop string ends the row before this many
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest's (0: off)
    # tokens of the prompt or the output so far: a logit > 0 divided by it, < 0 multiplied (1: off)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # subtracted from each token's logit once it is in the output
    frequency_penalty: float = 0.0  # x the times a token is in the output, subtracted
    logit_bias: LogitBias = ()  # added to those tokens' logits, each in [-100, 100]
    # each prompt token's logprob handed back, with this many likeliest alternatives (None: off)
    prompt_logprobs: int | None = None
    pooling: Pooling | None = None  # a pooled row: its prompt pooled, nothing sampled (None: off)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be in [0, 2**63) (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS}]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens], got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        check_penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Does a penalty need the counts of its tokens (engine/penalties.py)?"""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
        )


SamplingParams = DecodeParams  # the engine's class under its former name (scripts, tests)


def vocab_error(params: DecodeParams, vocab: int) -> str | None:
    """Why params cannot run on a vocabulary of `vocab` tokens: a logit_bias or stop token id
    outside it (it would index past the logits: a crash, a device assert on a GPU)."""
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if t >= vocab]
        if bad:
            return (
                f"{name} token id {bad[0]} is not in the model's vocabulary (0 to "
                f"{vocab - 1}); use this model's token ids (its tokenizer's)"
            )
    return None


def check_penalties(repetition: float, presence: float, frequency: float) -> None:
    """vLLM's ranges: repetition_penalty > 0, presence and frequency in [-2, 2]; ValueError."""
    if not (math.isfinite(repetition) and repetition > 0):
        raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {repetition}")
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= v <= 2.0:  # NaN fails it too
            raise ValueError(f"{name} must be in [-2, 2] (0 is off), got {v}")


def logit_bias_pairs(value: Any) -> LogitBias:
    """A logit bias as (token id, bias) pairs sorted by id, each bias clamped to [-100, 100]
    (vLLM's and OpenAI's range), from {id: bias} with int or string keys (OpenAI's JSON), its
    JSON text, or (id, bias) pairs (an Arrow map column's rows). ValueError naming the value."""
    if value is None:
        return ()
    if isinstance(value, str | bytes):
        if len(value) > MAX_LOGIT_BIAS_TOKENS * 64:  # longer than any map of that many entries
            raise ValueError(f"logit_bias text of {len(value)} characters is too long")
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(
                f'logit_bias {value!r} is not JSON; write it as {{"token id": bias}}'
            ) from None
    items = value.items() if isinstance(value, Mapping) else value
    try:
        # None: a struct column's field that another row set
        pairs = [(k, v) for k, v in items if v is not None]
    except (TypeError, ValueError):
        raise ValueError(f'logit_bias {value!r} is not a {{"token id": bias}} mapping') from None
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(
            f"logit_bias holds {len(pairs)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are taken"
        )
    out: dict[int, float] = {}
    for k, v in pairs:
        tok = int(k) if isinstance(k, str) and k.strip().isdigit() else k
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias key {k!r} is not a token id (an integer >= 0)")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"logit_bias of token {tok} is {v!r}, not a finite number")
        out[tok] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(v)))
    return tuple(sorted(out.items()))
