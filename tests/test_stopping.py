"""Stopping: EOS ids from generation_config, per-row max_new_tokens, stop strings, ignore_eos."""

import json
import shutil

import pytest
import torch
from helpers import cpu_llm

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import FinishReason, SamplingParams
from batchgen.engine.stopping import first_stop, tokens_to_keep, trim_at_stop

ENGINE = EngineConfig(max_num_seqs=8, block_size=4)
MAX_NEW = 24

# --- the host-side helpers, on a toy detokenizer ------------------------------------------

PIECES = {0: "He", 1: "llo", 2: " wo", 3: "rld", 4: "!", 5: "\n\n", 6: "ok"}


def toy_decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize(
    "stops, keep",
    [
        (["o w"], 3),  # spans tokens 1 and 2: needs the third token
        (["lo"], 2),
        (["!"], 5),
        (["rld", "llo"], 2),  # whichever completes first
        (["", "rl"], 4),  # empty stop strings are ignored
        (["xyz"], None),
        ([], None),
    ],
)
def test_tokens_to_keep(stops, keep):
    assert tokens_to_keep([0, 1, 2, 3, 4, 5, 6], stops, toy_decode) == keep


def test_a_step_without_a_stop_decodes_only_the_tail():
    """Checked after each token, a long row costs the same per step: only its last
    2 * len(longest stop) + 4 tokens are decoded until one holds a stop string."""
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return toy_decode(ids)

    row = [6] * 500 + [0, 1]
    assert tokens_to_keep(row, ["rld"], decode) is None and seen == [10]
    seen.clear()
    assert tokens_to_keep([*row, 2, 3], ["rld"], decode) == 504  # found: cut exactly
    assert seen[0] == 10


def test_tokens_to_keep_is_the_shortest_prefix():
    ids = [0, 1, 2, 3, 4, 5, 6, 0, 1]
    for stop in ["Hello", "world", "!\n", "okHe", "llo wor"]:
        k = tokens_to_keep(ids, [stop], toy_decode)
        assert stop in toy_decode(ids[:k]) and stop not in toy_decode(ids[: k - 1])
    assert tokens_to_keep([], ["x"], toy_decode) is None


def test_trim_at_stop_and_first_stop():
    text = "Hello world!\n\nok"
    assert trim_at_stop(text, ["o w", "ld"]) == "Hell"  # earliest start wins
    assert trim_at_stop(text, ["\n\n"]) == "Hello world!"
    assert trim_at_stop(text, ["He"]) == ""
    assert trim_at_stop(text, ["nope"]) == text
    assert trim_at_stop(text, []) == text
    assert first_stop(text, ["ok", "", "!"]) == 11
    assert first_stop(text, [""]) is None


# --- through LLM.generate -----------------------------------------------------------------


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 16, (n,), generator=g).tolist()
    # ids >= 2: no bos/eos in prompts
    return [torch.randint(2, 500, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def llama_dir(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return cpu_llm(llama_dir, engine=ENGINE)


@pytest.fixture(scope="module")
def free_runs(llm):
    """Four prompts run with ignore_eos: the token streams every other test cuts."""
    prompts = _prompts(4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert all(len(o.token_ids) == MAX_NEW for o in outs)
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
    return prompts, [o.token_ids for o in outs]


def _with_eos(src, dst, eos_ids: list[int]):
    """A copy of the checkpoint whose generation_config names other EOS ids."""
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos_ids
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_eos_from_generation_config_stops_a_row(llama_dir, free_runs, tmp_path):
    prompts, full = free_runs
    # An EOS id that row 0 produces (first at step k) and rows 1-3 never do.
    others = {t for row in full[1:] for t in row}
    k = next(
        i for i, t in enumerate(full[0]) if i >= 3 and t not in full[0][:i] and t not in others
    )
    eos = full[0][k]
    model_dir = _with_eos(llama_dir, tmp_path / "m", [3, eos])  # a list, as Llama 3 has
    llm = cpu_llm(model_dir, engine=ENGINE)

    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert outs[0].token_ids == full[0][: k + 1]  # EOS included
    assert outs[0].finish_reason == FinishReason.STOP
    for o, ref in zip(outs[1:], full[1:], strict=True):  # neighbours run on to their length
        assert o.token_ids == ref and o.finish_reason == FinishReason.LENGTH

    ignored = llm.generate(prompts[:1], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert ignored[0].token_ids == full[0]
    assert ignored[0].finish_reason == FinishReason.LENGTH


def test_config_eos_stops_by_default(llm):
    """The tiny checkpoint's own EOS (id 1): a row that produces it stops there, EOS included;
    its neighbour runs on."""
    prompts = ["label the sentiment", "the quick brown fox"]
    free = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    full = [o.token_ids for o in free]
    assert 1 in full[0][:-1] and 1 not in full[1]  # this tiny model's greedy run emits EOS
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert outs[0].token_ids == full[0][: full[0].index(1) + 1]
    assert outs[0].finish_reason == FinishReason.STOP
    assert "<|endoftext|>" not in outs[0].text  # EOS is a special token: not in the text
    assert outs[1].token_ids == full[1] and outs[1].finish_reason == FinishReason.LENGTH


def test_per_row_max_new_tokens_in_a_mixed_batch(llm, free_runs):
    prompts, full = free_runs
    limits = [3, MAX_NEW, 9, 1]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in limits]
    outs = llm.generate(prompts, params)
    for o, ref, n, p in zip(outs, full, limits, prompts, strict=True):
        assert o.token_ids == ref[:n]
        assert o.finish_reason == FinishReason.LENGTH
        assert o.prompt_tokens == len(p)
        assert len(o.logprobs) == n and all(lp <= 0 for lp in o.logprobs)
    assert [o.index for o in outs] == [0, 1, 2, 3]


def _ascii_stop(llm, ids: list[int], min_k: int) -> tuple[str, int]:
    """A stop string: the text of a plain-ASCII token at step k >= min_k, not seen before it."""
    for k in range(min_k, len(ids)):
        piece = llm.detokenize([ids[k]])
        plain = len(piece) >= 2 and piece.isascii() and piece.strip().isalnum()
        if plain and tokens_to_keep(ids, [piece], llm.detokenize) == k + 1:
            return piece, k
    raise AssertionError("no usable stop string in the reference output")


def test_stop_string_trims_text_and_tokens(llm, free_runs):
    prompts, full = free_runs
    stop, k = _ascii_stop(llm, full[0], min_k=3)
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop=(stop, "never-there")),
        SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
    ]
    outs = llm.generate(prompts[:2], params)
    row = outs[0]
    assert row.finish_reason == FinishReason.STOP
    assert row.token_ids == full[0][: k + 1]  # up to the token that completes the stop string
    full_text = llm.detokenize(full[0])
    assert row.text == full_text[: full_text.index(stop)]
    assert stop not in row.text
    # the neighbour without stop strings is untouched
    assert outs[1].token_ids == full[1] and outs[1].finish_reason == FinishReason.LENGTH
    assert outs[1].text == llm.detokenize(full[1])


def test_stop_string_that_never_matches_runs_to_length(llm, free_runs):
    prompts, full = free_runs
    sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop=("\x00never\x00",))
    (out,) = llm.generate(prompts[:1], sp)
    assert out.token_ids == full[0] and out.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # learned positions and RoPE
def test_rows_that_each_fit_the_context_run_together(family, tiny_dirs):
    """Regression: a long prompt with few new tokens next to a short prompt with many, each
    within the 256 positions; the finished row kept stepping past position 255 (IndexError)."""
    llm = cpu_llm(tiny_dirs[family], engine=EngineConfig(max_num_seqs=2))
    long_prompt, short_prompt = list(range(2, 122)), [5, 6, 7]
    params = [
        SamplingParams(max_new_tokens=10, ignore_eos=True),
        SamplingParams(max_new_tokens=140, ignore_eos=True),  # 140 steps: past 255 for row 0
    ]
    both = llm.generate([long_prompt, short_prompt], params)
    assert [len(c.token_ids) for c in both] == [10, 140]
    for prompt, p, c in zip([long_prompt, short_prompt], params, both, strict=True):
        assert c.token_ids == llm.generate([prompt], p)[0].token_ids

    # one token more than the positions left: an error completion, not an exception
    (over,) = llm.generate([long_prompt], SamplingParams(max_new_tokens=256 - len(long_prompt) + 1))
    assert over.finish_reason == FinishReason.ERROR and over.token_ids == []
    assert "exceeds the model's 256 positions" in over.error
    (fits,) = llm.generate(
        [long_prompt], SamplingParams(max_new_tokens=256 - len(long_prompt), ignore_eos=True)
    )
    assert len(fits.token_ids) == 256 - len(long_prompt)
