"""vLLM's `SamplingParams`: the Python API's sampling parameters, with vLLM's names and
defaults (temperature 1.0, max_tokens 16, seed None: an independent random sample per request),
over the engine's `DecodeParams` (engine/params.py), which the command line fills from its own
documented defaults (greedy, 64 tokens)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.engine.params import Constraint, DecodeParams
from batchgen.engine.sequence import Request
from batchgen.errors import RequestError
from batchgen.job.generation import model_defaults
from batchgen.job.seeds import SEED_RANGE, row_seed

log = logging.getLogger(__name__)

VLLM_MAX_TOKENS = 16  # vLLM's default max_tokens


@dataclass(slots=True, frozen=True, init=False)
class SamplingParams(DecodeParams):
    """The engine's parameters under vLLM's names and defaults, with `n` samples per prompt.

    max_tokens (or max_new_tokens): tokens to generate, 16 by default; temperature 1.0 by
    default, 0 is greedy; top_k -1 or 0 is off; stop: one string or a list of them; seed None:
    each request samples on a seed of its own (drawn from the LLM's `seed`), an int: the same
    tokens on every call; logprobs k: each generated token's logprob and its k likeliest
    alternatives (`CompletionOutput.logprobs`, vLLM's list of {token id: Logprob}; None: no
    logprobs); stop_token_ids: tokens that end the output (kept in token_ids, out of the text;
    `.stop_reason` says which); min_tokens: nothing but max_tokens ends it sooner; min_p 0 is
    off; repetition_penalty (1 is off), presence_penalty, frequency_penalty (0 is off) and
    logit_bias ({token id: bias}, clamped to [-100, 100]) as vLLM applies them, to the raw
    logits; skip_special_tokens: leave special tokens out of the text;
    include_stop_str_in_output: keep the stop string that ended the output in its text;
    prompt_logprobs k: each prompt token's logprob and its k likeliest alternatives
    (`RequestOutput.prompt_logprobs`)."""

    n: int = 1
    logprobs: int | None = None
    random_seed: bool = True  # seed None: a seed per request, drawn by the LLM
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __init__(
        self,
        n: int = 1,
        *,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        max_new_tokens: int | None = None,
        constraint: Constraint | None = None,
        stop_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int | str, float] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        prompt_logprobs: int | None = None,
    ) -> None:
        if max_tokens is not None and max_new_tokens not in (None, max_tokens):
            raise ValueError(
                f"max_tokens {max_tokens} and max_new_tokens {max_new_tokens}: pass one"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
            raise ValueError(f"logprobs must be an integer or None, got {logprobs!r}")
        for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
            if not math.isfinite(v):  # NaN passes every comparison the engine's checks make
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        DecodeParams.__init__(
            self,
            max_new_tokens=next(
                (v for v in (max_tokens, max_new_tokens) if v is not None), VLLM_MAX_TOKENS
            ),
            temperature=temperature,
            top_k=0 if top_k == -1 else top_k,  # vLLM's "off"
            top_p=top_p,
            seed=0 if seed is None else seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            ignore_eos=ignore_eos,
            constraint=constraint,
            top_logprobs=logprobs or 0,
            stop_token_ids=tuple(stop_token_ids or ()),
            min_tokens=min_tokens,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,  # made (id, bias) pairs there
            prompt_logprobs=prompt_logprobs,
        )
        for name, v in (
            ("n", n),
            ("logprobs", logprobs),
            ("random_seed", seed is None),
            ("skip_special_tokens", bool(skip_special_tokens)),
            ("include_stop_str_in_output", bool(include_stop_str_in_output)),
        ):
            object.__setattr__(self, name, v)

    @classmethod
    def from_model(cls, gen: Mapping[str, Any]) -> SamplingParams:
        """vLLM's `LLM.get_default_sampling_params()`: the values the model's
        generation_config.json (gen) sets (max_new_tokens, temperature, top_p, top_k;
        `do_sample: false` is greedy, as in transformers), vLLM's defaults for the rest."""
        d = model_defaults(gen)
        return cls(
            max_tokens=d.get("max_new_tokens"),
            **{k: d[k] for k in ("temperature", "top_p", "top_k") if k in d},
        )

    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    def sample(self, k: int, seed: int | None = None) -> DecodeParams:
        """The engine's parameters of sample k; seed: the request's (this one's own when it
        has one, else the caller draws it). Sample 0 runs on that seed, each other on one
        derived from it and k."""
        base = self.seed if seed is None or not self.random_seed else seed
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecodeParams)}
        return DecodeParams(**{**fields, "seed": row_seed(base, 0, k) if k else base})


def engine_params(
    sp: DecodeParams, k: int, draw_seed: Callable[[], int], max_new_tokens: int | None = None
) -> DecodeParams:
    """Sample k of a request under sp: the API's SamplingParams, or the engine's own (no `n`,
    a fixed seed, taken as it is: a row past the model's positions is the engine's error row).
    draw_seed() gives a seed for a request asking for a random one. max_new_tokens: a smaller
    bound (the model length left after the prompt: vLLM stops an output there), if any."""
    if not isinstance(sp, SamplingParams):
        return sp
    out = sp.sample(k, draw_seed() % SEED_RANGE if sp.random_seed else None)
    if max_new_tokens is not None and max_new_tokens < out.max_new_tokens:
        out = dataclasses.replace(
            out,
            max_new_tokens=max_new_tokens,
            min_tokens=min(out.min_tokens, max_new_tokens),
        )
    return out


def sample_requests(
    ids: list[list[int]],
    params: DecodeParams | Sequence[DecodeParams],
    draw_seed: Callable[[], int],
    max_model_len: int,
) -> tuple[list[Request], list[tuple[int, int, DecodeParams]]]:
    """The engine's requests for prompts `ids` under params (one for all, or one each): each
    prompt's n samples, an output bounded by what max_model_len leaves after its prompt (vLLM
    stops one there); and each request's (prompt, sample, params)."""
    per_row = [params] * len(ids) if isinstance(params, DecodeParams) else list(params)
    if len(per_row) != len(ids):
        raise RequestError(f"{len(per_row)} sampling params for {len(ids)} prompts")
    for sp in per_row:  # the engine's own class takes a NaN temperature
        if not isinstance(sp, DecodeParams):
            raise RequestError(f"sampling_params must be SamplingParams, got {sp!r}")
        if not (math.isfinite(sp.temperature) and math.isfinite(sp.top_p)):
            raise RequestError(f"temperature and top_p must be finite numbers, got {sp}")
    requests, owner = [], []
    for i, (p, sp) in enumerate(zip(ids, per_row, strict=True)):
        room = max_model_len - len(p)
        for k in range(getattr(sp, "n", 1)):
            requests.append(Request(len(requests), p, engine_params(sp, k, draw_seed, room)))
            owner.append((i, k, sp))
    if any(getattr(sp, "n", 1) > 1 and sp.greedy for sp in per_row):
        warn_greedy_samples()
    return requests, owner


@functools.cache
def warn_greedy_samples() -> None:
    log.warning(
        "n > 1 with temperature 0 (greedy) gives n identical completions; pass a temperature "
        "above 0 (e.g. temperature=0.8) to sample different ones (warned once)"
    )
