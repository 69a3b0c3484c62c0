"""The model's tokenizer, loaded without ever running the checkpoint's own code, checked
against the model's vocabulary, and the model's EOS ids (generation_config.json, config.json,
then the tokenizer), each problem a one-line ModelLoadError."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchgen.errors import ModelLoadError
from batchgen.model.families.hf_config import read_json_object


def eos_token_ids(gen: Mapping[str, Any], hf: dict, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (gen), else config.json (hf), else the tokenizer."""
    for name, cfg in (("generation_config.json", gen), ("config.json", hf)):
        eos = cfg.get("eos_token_id")
        if eos is not None:
            ids = [eos] if not isinstance(eos, list) else eos
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ModelLoadError(
                    f"{name}: eos_token_id {eos!r} is not a token id or a list of them; fix "
                    "it (e.g. 2 or [2, 32000]) or remove it"
                )
            return ids
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


# Where AutoTokenizer gives transformers' generic fast tokenizer (TokenizersBackend): a
# tokenizer_config.json naming it, for a model type with no tokenizer class of its own
# (qwen2 has one). Loaded as that class directly, skipping AutoTokenizer's lookup tables, it
# is the same tokenizer ~1.3 s sooner (measured, a 32k vocabulary); tests/test_model_spec.py
# checks that AutoTokenizer still picks the generic class for these model types.
GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
GENERIC_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen3"})


# The files a tokenizer is saved as (its config, a fast tokenizer, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path, model_type: str | None = None):
    """The tokenizer saved with the model, the checkpoint's own code never run; ModelLoadError
    (one line) for none, one that needs its own code (`auto_map`) or one that does not load."""
    config_file = model_dir / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    generic = (
        model_type in GENERIC_MODEL_TYPES
        and config.get("tokenizer_class") in GENERIC_TOKENIZERS
        and (model_dir / "tokenizer.json").is_file()
    )
    try:
        if generic:
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(
                str(model_dir), local_files_only=True, trust_remote_code=False
            )
    except Exception as e:  # transformers raises any kind for a missing or damaged tokenizer
        why = " ".join(str(e).split())[:300]
    else:
        # Prompts are bounded by the model's positions (job/tokenization.py, with its own one
        # warning); the tokenizer's model_max_length only printed transformers' "Token indices
        # sequence length is longer than ..." into the job's output. 1e30: transformers' "none".
        tok.model_max_length = int(1e30)
        return tok
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{model_dir} has no tokenizer (no {', '.join(TOKENIZER_FILES)}); save the model's "
            "tokenizer into it (tokenizer.save_pretrained(DIR))"
        )
    if "auto_map" in config:
        why = "it names a class of the checkpoint's own code (auto_map), which batchgen never runs"
    raise ModelLoadError(
        f"{model_dir}: the tokenizer does not load ({why}); restore tokenizer_config.json and the "
        "tokenizer's files from the model's source"
    )


def check_vocab(model_dir: Path, tokenizer_size: int, vocab_size: int) -> None:
    """A tokenizer with ids the model has no embedding for would fail mid-run on the first
    prompt that holds one (an index error, 0 rows written): refuse it at load. A smaller
    tokenizer is common (embeddings padded to a multiple of 64) and fine."""
    if tokenizer_size > vocab_size:
        raise ModelLoadError(
            f"{model_dir}: the tokenizer has {tokenizer_size} tokens and the model's vocabulary "
            f"(config.json vocab_size) {vocab_size}; token ids {vocab_size} and up have no "
            "embedding. Use the tokenizer that came with the model"
        )
