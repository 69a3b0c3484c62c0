"""The Python API's plain types, named as in vLLM: SamplingParams (the engine's, under vLLM's
names too, with `n` samples) and RequestOutput (one prompt's completions)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.engine import sequence
from batchgen.engine.sequence import Completion, Constraint
from batchgen.job.generation import GenerationDefaults, read_generation_config
from batchgen.job.prompt_logprobs import Logprob, as_vllm
from batchgen.job.seeds import row_seed


@dataclass(slots=True, frozen=True, init=False)
class SamplingParams(sequence.SamplingParams):
    """The engine's sampling parameters under vLLM's names too, with `n` samples per prompt.

    max_tokens (or max_new_tokens): tokens to generate, 64 by default (vLLM's is 16);
    temperature 0 (the default; vLLM's is 1.0) is greedy; top_k -1 or 0 is off; stop: one
    string or a list of them; logprobs: the likeliest alternatives kept per generated token (each
    token's own logprob is always in `.logprobs`); seed None means 0; stop_token_ids: tokens
    that end the output (kept in token_ids, out of the text; `.stop_reason` says which);
    min_tokens: nothing but max_tokens ends it sooner; min_p 0 is off; repetition_penalty
    (1 is off), presence_penalty, frequency_penalty (0 is off) and logit_bias ({token id:
    bias}, clamped to [-100, 100]) as vLLM applies them, to the raw logits; prompt_logprobs:
    each prompt token's logprob and this many alternatives (`RequestOutput.prompt_logprobs`)."""

    n: int = 1

    def __init__(
        self,
        n: int = 1,
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        max_new_tokens: int | None = None,
        top_logprobs: int | None = None,
        constraint: Constraint | None = None,
        stop_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int | str, float] | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        if max_tokens is not None and max_new_tokens not in (None, max_tokens):
            raise ValueError(
                f"max_tokens {max_tokens} and max_new_tokens {max_new_tokens}: pass one"
            )
        if logprobs is not None and top_logprobs not in (None, logprobs):
            raise ValueError(f"logprobs {logprobs} and top_logprobs {top_logprobs}: pass one")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
            if not math.isfinite(v):  # NaN passes every comparison the engine's checks make
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        sequence.SamplingParams.__init__(
            self,
            max_new_tokens=next((v for v in (max_tokens, max_new_tokens) if v is not None), 64),
            temperature=temperature,
            top_k=0 if top_k == -1 else top_k,  # vLLM's "off"
            top_p=top_p,
            seed=0 if seed is None else seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            ignore_eos=ignore_eos,
            constraint=constraint,
            top_logprobs=next((v for v in (logprobs, top_logprobs) if v is not None), 0),
            stop_token_ids=tuple(stop_token_ids or ()),
            min_tokens=min_tokens,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,  # made (id, bias) pairs there
            prompt_logprobs=prompt_logprobs,
        )
        object.__setattr__(self, "n", n)

    @classmethod
    def from_model(
        cls, model_dir: str | Path, gen: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """The model's generation_config.json defaults (max_new_tokens, temperature, top_p,
        top_k; do_sample false: greedy), batchgen's where it sets none: what vLLM's
        `LLM.get_default_sampling_params()` gives, and `generate` uses when given none."""
        gen = read_generation_config(model_dir) if gen is None else gen
        d = GenerationDefaults.resolve({}, gen).values
        return cls(
            max_tokens=int(d["max_new_tokens"]),
            temperature=d["temperature"],
            top_p=d["top_p"],
            top_k=int(d["top_k"]),
        )

    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    def sample(self, k: int) -> sequence.SamplingParams:
        """The engine's parameters of sample k: each sample its own seed, the first the given."""
        fields = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(sequence.SamplingParams)
        }
        return sequence.SamplingParams(
            **{**fields, "seed": row_seed(self.seed, 0, k) if k else self.seed}
        )


_COMPLETION_NAMES = frozenset(f.name for f in dataclasses.fields(Completion)) | {
    "completion_tokens"
}


@dataclass(slots=True)
class RequestOutput:
    """One prompt's results, shaped like vLLM's: `outputs` holds its n completions (`text`,
    `token_ids`, `finish_reason`, `logprobs`; `index` the sample's number). The first
    completion's fields also read on the result itself (`out.text`, `out.finish_reason`: the
    names batchgen's generate returned before)."""

    index: int  # the prompt's place in the call
    prompt: str | None  # None: given as token ids
    prompt_token_ids: list[int]
    outputs: list[Completion]

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def finished(self) -> bool:
        return True

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """With `SamplingParams(prompt_logprobs=k)`: vLLM's shape (job/prompt_logprobs.py)."""
        return as_vllm(self.prompt_token_ids, self.outputs[0] if self.outputs else None)

    def __getattr__(self, name: str) -> Any:
        if name in _COMPLETION_NAMES:
            return getattr(self.outputs[0], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def is_token_ids(x: Any) -> bool:
    """A prompt given as token ids (the API's generate takes text, ids or dicts)?"""
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def is_candidate_list(x: Sequence) -> bool:
    """One list of candidates (texts or id lists), rather than one list per prompt?"""
    return all(
        isinstance(c, str) or (isinstance(c, list) and all(isinstance(t, int) for t in c))
        for c in x
    )
