"""Prompt text -> token ids, with the job's truncation policy.

A text far longer than the prompt limit could hold is cut before it is tokenized (a 10 MB cell
took 2.9 GB and 13.6 s to tokenize, only to be skipped): no token spans more than
MAX_CHARS_PER_TOKEN characters, so the kept piece still holds the limit's tokens and
SPARE_TOKENS more, and the tokens the policy keeps are exactly those of the whole text: the
piece is cut at the end the policy drops (the start under --truncate left), and what the cut
changes (a word split in two, a BOS or EOS where the text did not start or end) lies among the
spare tokens. A piece that comes out without them (tokens longer than the bound) is tokenized
whole after all."""

from __future__ import annotations

import logging

from batchgen.choices import Truncate
from batchgen.errors import PromptTooLong, RowError

log = logging.getLogger(__name__)

MAX_CHARS_PER_TOKEN = 32  # generous: real vocabularies' longest tokens stay well below
SPARE_TOKENS = 64


def tokenize(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Batched tokenization (fast tokenizers run this in parallel in Rust)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def tokenize_prompts(
    tokenizer, texts: list[str], max_len: int, policy: Truncate, add_special_tokens: bool = True
) -> list[tuple[list[int], bool]]:
    """Each text's token ids for fit_length, and whether they are of a cut piece of it (see
    the module docstring)."""
    keep = (max_len + SPARE_TOKENS) * MAX_CHARS_PER_TOKEN
    cut = [len(t) > 2 * keep for t in texts]
    pieces = [
        (t[-keep:] if policy is Truncate.LEFT else t[:keep]) if c else t
        for t, c in zip(texts, cut, strict=True)
    ]
    lists = tokenize(tokenizer, pieces, add_special_tokens)
    redo = [i for i, c in enumerate(cut) if c and len(lists[i]) <= max_len + SPARE_TOKENS]
    whole = tokenize(tokenizer, [texts[i] for i in redo], add_special_tokens)
    for i, ids in zip(redo, whole, strict=True):
        lists[i], cut[i] = ids, False
    return list(zip(lists, cut, strict=True))


def fit_length(
    ids: list[int],
    max_len: int,
    policy: Truncate,
    cut: bool = False,
    limit_name: str = "--max-prompt-len",
) -> list[int]:
    """Apply the truncation policy to one prompt; raise RowError (skip) or PromptTooLong.
    cut: ids are of the text's first or last part only, so the text has more. limit_name:
    what set max_len (a flag, or the model's positions less the new tokens)."""
    if not ids:
        raise RowError("prompt tokenized to zero tokens")
    if len(ids) <= max_len:
        return ids
    if policy == Truncate.LEFT:
        return ids[-max_len:]
    if policy == Truncate.RIGHT:
        return ids[:max_len]
    msg = (
        f"prompt has {len(ids)}{'+' * cut} tokens, more than max_prompt_len {max_len} "
        f"(set by {limit_name})"
    )
    if policy == Truncate.ERROR:
        raise PromptTooLong(f"{msg}; pass --truncate left|right|skip or raise the limit")
    raise RowError(f"{msg} (skipped; --truncate left|right keeps part of it)")


def warn_cut(kept: list[int], total: int, policy: Truncate) -> bool:
    """Warn when --truncate kept under a quarter of a prompt's tokens, or under 8 of them
    (--max-new-tokens 255 on a model of 256 positions keeps one); whether it warned."""
    n = len(kept)
    if n == total or (n >= 8 and n * 4 >= total):
        return False
    log.warning(
        "--truncate %s kept %d of a prompt's %d tokens: prompts are cut to the model's positions "
        "less --max-new-tokens (or to --max-prompt-len); lower --max-new-tokens, or use a model "
        "with more positions, if that is not meant (warned once)",
        policy.value,
        n,
        total,
    )
    return True
