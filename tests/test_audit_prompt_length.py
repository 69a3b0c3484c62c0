"""Prompts over the limit (audit, issue 32): a cell far over it is cut before it is tokenized,
with the same tokens kept under --truncate left/right; a cut that keeps only a sliver of a
prompt is warned about once."""

import logging
import random

import pytest
import transformers
from helpers import prompts, read_output, run_job, write_parquet
from transformers import AutoTokenizer

from batchgen.choices import Truncate
from batchgen.job.tokenization import MAX_CHARS_PER_TOKEN, SPARE_TOKENS, tokenize_prompts

LIMIT = 254  # the tiny model's 256 positions less --max-new-tokens 2


@pytest.fixture
def longest_text_tokenized(monkeypatch):
    """The length of the longest text any tokenizer call is given."""
    seen = [0]
    call = transformers.PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kw):
        texts = [text] if isinstance(text, str) else list(text or [])
        seen[0] = max([seen[0], *map(len, texts)])
        return call(self, texts if not isinstance(text, str) else text, *args, **kw)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", spy)
    return seen


def _long_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = " ".join(prompts(40)).split()
    out, n = [], 0
    while n < chars:
        w = rng.choice(words) + rng.choice([" ", " ", ", ", ".\n", ""])
        out.append(w)
        n += len(w)
    return "".join(out)


@pytest.mark.parametrize("truncate", ["skip", "left", "right"])
def test_a_huge_cell_is_cut_before_tokenizing(tmp_path, model, longest_text_tokenized, truncate):
    huge = _long_text(400_000)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the quick brown fox", huge]})
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 2, "--truncate", truncate)
    assert longest_text_tokenized[0] <= (LIMIT + SPARE_TOKENS) * MAX_CHARS_PER_TOKEN
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows[0]["error"] is None
    if truncate == "skip":
        assert f"more than max_prompt_len {LIMIT}" in rows[1]["error"]
        assert "--truncate left|right" in rows[1]["error"]
    else:
        assert rows[1]["error"] is None and rows[1]["prompt_tokens"] == LIMIT


def _whole(tok, texts, limit, policy, special):
    ids = tok(texts, add_special_tokens=special)["input_ids"]
    return [i[-limit:] if policy is Truncate.LEFT else i[:limit] for i in ids]


@pytest.mark.parametrize("policy", [Truncate.LEFT, Truncate.RIGHT])
@pytest.mark.parametrize("special", [True, False])
def test_cutting_keeps_exactly_the_truncated_tokens(model, policy, special):
    tok = AutoTokenizer.from_pretrained(str(model))
    limit = 50
    over = 2 * (limit + SPARE_TOKENS) * MAX_CHARS_PER_TOKEN
    texts = [
        _long_text(over + 1, seed=1),  # just past where cutting starts
        _long_text(over + 5003, seed=2),
        "a" * (over + 17),  # no spaces: one long pre-token
        "the lazy dog " * 5000,
        _long_text(over - 10, seed=3),  # not cut: tokenized whole
    ]
    got = tokenize_prompts(tok, texts, limit, policy, add_special_tokens=special)
    assert [c for _, c in got] == [True, True, True, True, False]
    kept = [i[-limit:] if policy is Truncate.LEFT else i[:limit] for i, _ in got]
    assert kept == _whole(tok, texts, limit, policy, special)


class _OneTokenPer100Chars:
    """A tokenizer whose tokens are longer than the bound: cut pieces come out short."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[len(t[i : i + 100]) for i in range(0, len(t), 100)] for t in texts]}


def test_tokens_longer_than_the_bound_fall_back_to_the_whole_text():
    limit = 10
    text = "x" * (3 * (limit + SPARE_TOKENS) * MAX_CHARS_PER_TOKEN + 55)
    ((ids, cut),) = tokenize_prompts(_OneTokenPer100Chars(), [text], limit, Truncate.LEFT)
    assert not cut and ids == _OneTokenPer100Chars()([text])["input_ids"][0]


def test_a_cut_to_a_sliver_is_warned_once(tmp_path, model, caplog):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(6)})
    with caplog.at_level(logging.WARNING):
        run_job(src, tmp_path / "out", model, "--max-new-tokens", 255, "--truncate", "left")
    warned = [r.getMessage() for r in caplog.records if "kept 1 of a prompt's" in r.getMessage()]
    assert len(warned) == 1 and "--max-new-tokens" in warned[0]
    assert all(r["prompt_tokens"] == 1 for r in read_output(tmp_path / "out").to_pylist())


def test_a_mild_cut_is_not_warned(tmp_path, model, caplog):
    long = "the quick brown fox " * 12  # a few tokens over the limit
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [long]})
    with caplog.at_level(logging.WARNING):
        run_job(src, tmp_path / "out", model, "--max-prompt-len", 40, "--truncate", "right")
    assert not [r for r in caplog.records if "kept" in r.getMessage()]
