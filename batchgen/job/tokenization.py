"""Prompt text -> token ids, with the job's truncation policy."""

from __future__ import annotations

from batchgen.choices import Truncate
from batchgen.errors import PromptTooLong, RowError


def tokenize(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Batched tokenization (fast tokenizers run this in parallel in Rust)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def fit_length(ids: list[int], max_len: int, policy: Truncate) -> list[int]:
    """Apply the truncation policy to one prompt; raise RowError (skip) or PromptTooLong."""
    if not ids:
        raise RowError("prompt tokenized to zero tokens")
    if len(ids) <= max_len:
        return ids
    if policy == Truncate.LEFT:
        return ids[-max_len:]
    if policy == Truncate.RIGHT:
        return ids[:max_len]
    msg = f"prompt has {len(ids)} tokens, more than max_prompt_len {max_len}"
    if policy == Truncate.ERROR:
        raise PromptTooLong(f"{msg}; pass --truncate left|right|skip or raise --max-prompt-len")
    raise RowError(f"{msg} (skipped; --truncate left|right keeps part of it)")
