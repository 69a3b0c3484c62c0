"""Whether a request can run at all, checked once as it enters the engine: its longest
sequence within the model's positions and the KV pool, its constraint's grammar compiled, its
logit_bias and stop token ids within the vocabulary. A request that cannot run becomes its
own error completion (engine.py); the job goes on."""

from __future__ import annotations

from batchgen.engine.constraints import ConstraintError, Grammars
from batchgen.engine.params import vocab_error
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request


def admission_error(
    r: Request,
    longest: Request,
    max_positions: int,
    scheduler: Scheduler,
    grammars: Grammars | None,
    vocab: int,
) -> str | None:
    """Why r cannot run (longest: the longest of the sequences it runs as), or None."""
    return (
        _size_error(r, longest, max_positions, scheduler)
        or _constraint_error(r, grammars)
        or vocab_error(r.params, vocab)
    )


def _size_error(r: Request, longest: Request, limit: int, scheduler: Scheduler) -> str | None:
    if longest.max_tokens > limit:
        why = f"exceeds the model's {limit} positions"
    elif not scheduler.fits(longest):
        why = f"exceeds the KV cache's {scheduler.capacity_tokens} tokens; raise --kv-cache-tokens"
    else:
        return None
    if r.scoring:  # a prompt-logprobs row: its prompt only
        return f"prompt ({r.prompt_len} tokens) {why}"
    if r.candidates:
        cand = longest.prompt_len - r.prompt_len
        return f"prompt ({r.prompt_len} tokens) + its longest candidate ({cand}) {why}"
    return f"prompt ({r.prompt_len} tokens) + max_new_tokens ({r.params.max_new_tokens}) {why}"


def _constraint_error(r: Request, grammars: Grammars | None) -> str | None:
    if r.params.constraint is None:
        return None
    if grammars is None:
        return "this engine was built without grammars; constrained outputs are off"
    try:
        grammars.compile(r.params.constraint)
    except ConstraintError as e:
        return str(e)
    return None
