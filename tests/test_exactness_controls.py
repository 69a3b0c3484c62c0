"""Negative controls for the exactness tests: a model missing one feature must fail them.

Each control removes one feature from batchgen's model by monkeypatching (the library is
untouched) and checks that the greedy tokens of a mixed batch then differ from transformers'
on at least one row, while the unpatched engine equals them (so the comparison is live). They
run on the sharpened tiny models that test_exactness.py uses (tiny_models.sharpen_attention):
a random init's attention is near-uniform, and on such a model the same removals can leave
every token unchanged, as the last test shows.

Not a control: dropping RMSNorm's epsilon (1e-6 next to a mean square near 1 changes no
token on any tiny model, sharpened or not).
"""

import dataclasses
import functools

import pytest
import torch.nn.functional as F
from helpers import hf_greedy, random_prompts

import batchgen.model.families.transformer as transformer
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM

PROMPTS = random_prompts([3, 11, 6, 17, 1, 25, 9])
MAX_NEW = 12


def _run(path, remove=None, monkeypatch=None) -> list[list[int]]:
    """The engine's greedy rows for PROMPTS, with remove(monkeypatch, llm) applied first."""
    llm = LLM(path, dtype="float32", device="cpu", compile=False)
    if remove is not None:
        remove(monkeypatch, llm)
    return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))]


def _with_config(monkeypatch, llm, **changes) -> None:
    monkeypatch.setattr(llm.model, "cfg", dataclasses.replace(llm.model.cfg, **changes))


def no_softmax_scale(monkeypatch, llm) -> None:
    """Attention logits q.k, not q.k / sqrt(head_dim). Patched in torch, for every caller
    in batchgen (the reference is computed before)."""
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: sdpa(*a, **{**kw, "scale": 1.0})
    )


def no_sliding_window(monkeypatch, llm) -> None:
    _with_config(monkeypatch, llm, sliding_window=None)


def no_rope(monkeypatch, llm) -> None:
    monkeypatch.setattr(transformer, "apply_rope", lambda x, cos, sin: x)


def wrong_rope_theta(monkeypatch, llm) -> None:
    """Qwen2's 10^6 where the checkpoint says 10^4 (the RoPE tables are built at generate)."""
    _with_config(monkeypatch, llm, rope_theta=llm.model.cfg.rope_theta * 100)


def no_qk_norm(monkeypatch, llm) -> None:
    for block in llm.model.layers:
        monkeypatch.setattr(block.attn, "q_norm", None)
        monkeypatch.setattr(block.attn, "k_norm", None)


# removal -> the sharpened models it must be caught on ("mistral" equals "llama" at these
# lengths, its 64-token window unused, so "mistral-window4" stands for it)
CONTROLS = {
    no_softmax_scale: ("gpt2", "llama", "qwen2", "qwen3", "mistral-window4"),
    no_sliding_window: ("mistral-window4",),
    no_rope: ("llama", "qwen2", "qwen3", "mistral-window4"),
    wrong_rope_theta: ("llama", "qwen2", "qwen3"),
    no_qk_norm: ("qwen3",),
}


@pytest.fixture(scope="module")
def reference(sharp_dirs):
    """model -> transformers' greedy rows for PROMPTS, checked equal to the unpatched
    engine's; computed once per model."""

    @functools.cache
    def rows(model: str) -> list[list[int]]:
        want = hf_greedy(sharp_dirs[model], PROMPTS, MAX_NEW)
        assert _run(sharp_dirs[model]) == want, f"{model}: the unpatched engine differs"
        return want

    return rows


@pytest.mark.parametrize(
    "remove, model",
    [(r, m) for r, models in CONTROLS.items() for m in models],
    ids=lambda x: x.__name__ if callable(x) else x,
)
def test_removal_changes_the_tokens(remove, model, sharp_dirs, reference, monkeypatch):
    want = reference(model)
    got = _run(sharp_dirs[model], remove, monkeypatch)
    assert got != want, f"{model} without {remove.__name__} still equals transformers"


@pytest.mark.parametrize(
    "remove, model",
    [(no_softmax_scale, "llama"), (no_rope, "qwen2"), (wrong_rope_theta, "qwen2")],
    ids=lambda x: x.__name__ if callable(x) else x,
)
def test_unsharpened_models_miss_removals(remove, model, tiny_dirs, monkeypatch):
    """Why the exactness tests run on sharpened models: on the plain tiny models (near-uniform
    attention) these removals leave every row's tokens as transformers has them (on the
    sharpened ones they change 3-7 rows of 7). Should this fail, the plain models have
    become discriminating; the controls above stand either way."""
    want = hf_greedy(tiny_dirs[model], PROMPTS, MAX_NEW)
    assert _run(tiny_dirs[model], remove, monkeypatch) == want
