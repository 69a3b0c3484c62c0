"""The decoder itself: cached decoding through the packed paged step equals a full
forward, attention over scattered blocks equals plain attention, RoPE tables.

The reference for every logit is an uncached full forward: transformers' model on the
unpadded sequence (use_cache=False), and our own prefill of the whole sequence.
"""

import math

import pytest
import torch
import transformers
from paged import Pages, all_logits
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.step import (
    PrefillSpan,
    decode_attention,
    decode_mask,
    prefill_attention,
    prefill_mask,
)
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.config import RopeScaling
from batchgen.model.families.rope import inv_frequencies

TOL = dict(rtol=1e-4, atol=1e-5)
MODELS = ["gpt2", "llama", "mistral-window4", "qwen2", "qwen3"]


def _seq(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()  # (T, V)


@pytest.fixture(scope="module")
def model_dirs(tiny_dirs, window_dir):
    # Mistral with a 4-token window, so the sliding-window masks are exercised by 14-token rows.
    return {**tiny_dirs, "mistral-window4": window_dir}


def _load(path) -> tuple:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_model(path, torch.float32, "cpu")


def _stale(model) -> None:
    """Garbage everywhere in the cache, as left by earlier sequences: masks must hide it."""
    for kv in model.kv_caches:
        kv.k.normal_(0, 100)
        kv.v.normal_(0, 100)


@pytest.mark.parametrize("family", MODELS)
def test_cached_decode_equals_full_forward(family, model_dirs):
    hf, model = _load(model_dirs[family])
    if family == "mistral-window4":
        assert model.cfg.sliding_window == 4
    pages = Pages(model, num_blocks=16, block_size=4)
    _stale(model)
    seqs = [_seq(14, 0), _seq(11, 1)]
    prompt_lens = [6, 3]
    refs = [_hf_logits(hf, s) for s in seqs]  # (T, V) each

    # both prompts in one packed step, then both rows decode together, one token a step,
    # in one decode group or in two (as the runner groups rows of different widths)
    logits = pages.step(
        prefills=[(i, 0, s[:n]) for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))]
    )
    for t in range(9):
        for i, n in enumerate(prompt_lens):
            torch.testing.assert_close(logits[i], refs[i][n - 1 + t], **TOL)
        if t < 8:
            feed = [
                (i, n + t, s[n + t]) for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))
            ]
            logits = pages.step(decodes=feed, groups=[1, 1] if t % 2 else None)

    # our own uncached prefill of the whole sequences agrees at every position
    for s, ref in zip(seqs, refs, strict=True):
        torch.testing.assert_close(all_logits(model, s), ref, **TOL)


@pytest.mark.parametrize("family", MODELS)
def test_chunked_prefill_next_to_a_decode_equals_full_forward(family, model_dirs):
    """A prompt prefilled in chunks of 5 (each attends to the cached earlier chunks) while
    another row decodes in the same steps."""
    hf, model = _load(model_dirs[family])
    pages = Pages(model, num_blocks=16, block_size=4)
    _stale(model)
    long, short = _seq(17, 2), _seq(12, 3)
    ref_long, ref_short = _hf_logits(hf, long), _hf_logits(hf, short)
    torch.testing.assert_close(pages.step(prefills=[(1, 0, short[:4])])[0], ref_short[3], **TOL)
    for k, start in enumerate(range(0, 17, 5)):
        chunk = long[start : start + 5]
        out = pages.step(
            decodes=[(1, 4 + k, short[4 + k])], prefills=[(0, start, chunk)], all_logits=True
        )
        torch.testing.assert_close(out[0], ref_short[4 + k], **TOL)
        torch.testing.assert_close(out[1:], ref_long[start : start + len(chunk)], **TOL)


@pytest.mark.parametrize("family", MODELS)
def test_a_shared_prefix_block_gives_the_same_logits(family, model_dirs):
    """Row b takes row a's first two blocks (a prefix-cache hit) and prefills only the
    rest of its prompt, on top of them."""
    hf, model = _load(model_dirs[family])
    pages = Pages(model, num_blocks=16, block_size=4)
    _stale(model)
    prefix = _seq(8, 4)
    a, b = prefix + _seq(5, 5), prefix + _seq(6, 6)
    pages.step(prefills=[(0, 0, a)])
    pages.share(0, 1, 2)
    out = pages.step(prefills=[(1, 8, b[8:])], all_logits=True)
    torch.testing.assert_close(out, _hf_logits(hf, b)[8:], **TOL)
    assert pages.tables[1][:2] == pages.tables[0][:2]


def test_batch_rows_do_not_interact(tiny_dirs):
    """A row's logits are the same alone and packed next to rows of other lengths."""
    model = load_model(tiny_dirs["qwen3"], torch.float32, "cpu")
    a, b, c = _seq(9, 2), _seq(4, 3), _seq(13, 4)
    alone = Pages(model).step(prefills=[(0, 0, b)])
    packed = Pages(model, seed=1).step(prefills=[(0, 0, a), (1, 0, b), (2, 0, c)])
    torch.testing.assert_close(packed[1], alone[0], **TOL)


def _naive(q, k, v, q_pos, window):
    """Plain softmax attention of queries q (n, H, D) at q_pos over keys k, v (S, Hkv, D)
    at positions 0..S-1: causal, windowed, each kv head shared by its query heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (S, H, D)
    scores = torch.einsum("nhd,shd->hns", q, k) / math.sqrt(q.shape[-1])
    k_pos = torch.arange(k.shape[0])
    ok = (k_pos[None, :] <= q_pos[:, None]) & (
        (q_pos[:, None] - k_pos[None, :]) < (window or 10**9)
    )
    w = scores.masked_fill(~ok, float("-inf")).softmax(-1)
    return torch.einsum("hns,shd->nhd", w, v)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_over_scattered_blocks_equals_plain_attention(window):
    torch.manual_seed(0)
    bs, h, hkv, d = 4, 4, 2, 8
    cache = PagedKVCache(12, bs, hkv, d, torch.float32, "cpu")
    cache.k.normal_(0, 100)  # stale everywhere
    cache.v.normal_(0, 100)
    lens = [10, 3]
    tables = [[7, 2, 9], [5]]
    ks = [torch.randn(n, hkv, d) for n in lens]
    vs = [torch.randn(n, hkv, d) for n in lens]
    for table, k, v in zip(tables, ks, vs, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(k))])
        cache.write(slots, k, v)

    # decode: each row's last token, tables padded with the scratch block
    q = torch.randn(2, h, d)
    blocks = torch.tensor([tables[0], tables[1] + [0, 0]])
    mask = decode_mask(torch.tensor(lens), 3 * bs, window)
    got = decode_attention(q, cache.k, cache.v, bs, blocks, mask)
    for i, n in enumerate(lens):
        want = _naive(q[i : i + 1], ks[i], vs[i], torch.tensor([n - 1]), window)[0]
        torch.testing.assert_close(got[i], want, **TOL)

    # prefill: the last 6 tokens of row 0 on top of its 4 cached ones
    q = torch.randn(6, h, d)
    span = PrefillSpan(0, 6, 4, torch.tensor(tables[0]))
    span.mask = prefill_mask(span, window, q.device)
    got = prefill_attention(q, ks[0][4:], vs[0][4:], cache, span)
    torch.testing.assert_close(got, _naive(q, ks[0], vs[0], torch.arange(4, 10), window), **TOL)
    # and from an empty cache, on its own keys
    span = PrefillSpan(0, 6, 0, None)
    span.mask = prefill_mask(span, window, q.device)
    got = prefill_attention(q, ks[0][:6], vs[0][:6], cache, span)
    torch.testing.assert_close(got, _naive(q, ks[0][:6], vs[0][:6], torch.arange(6), window), **TOL)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
)
def test_inv_frequencies_match_transformers(params):
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
    )
    kind = params["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(kind, LlamaRotaryEmbedding.compute_default_rope_parameters)
    hf_inv, attention_factor = init(hf_cfg, device="cpu")
    assert attention_factor == 1.0
    scaling = (
        RopeScaling()
        if kind == "default"
        else RopeScaling(
            kind=kind, **{k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
        )
    )
    ours = inv_frequencies(16, params["rope_theta"], scaling)
    assert torch.equal(ours, hf_inv.float())
