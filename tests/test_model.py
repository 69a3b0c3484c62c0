"""The decoder itself: cached decoding equals a full forward, masks, RoPE tables.

The reference for every logit is an uncached full forward: transformers' model on the
unpadded sequence (use_cache=False), and our own prefill of the whole prefix.
"""

import pytest
import torch
import transformers
from tiny_models import save_tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from batchgen.model.config import Family, ModelConfig, RopeScaling
from batchgen.model.loader import load_model
from batchgen.model.rope import inv_frequencies
from batchgen.model.transformer import Transformer

TOL = dict(rtol=1e-4, atol=1e-5)


def _seq(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(model: Transformer, rows: list[list[int]], width: int, stride: int) -> torch.Tensor:
    """Left-pad rows to width and run them in one call from cache slot 0; last logits (B, V)."""
    b = len(rows)
    tokens = torch.zeros(b, width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = torch.tensor(r)
    kv_start = torch.tensor([width - len(r) for r in rows])
    slots = torch.arange(width).expand(b, width)
    input_pos = (slots - kv_start[:, None]).clamp(min=0)
    return model(tokens, input_pos, slots, kv_start, width, stride)


def decode(model, tokens: list[int], slot: int, kv_start: torch.Tensor, stride: int):
    """One token per row at cache slot `slot`; attends over the whole row (kv_len = stride)."""
    b = len(tokens)
    slots = torch.full((b, 1), slot)
    return model(torch.tensor(tokens)[:, None], slots - kv_start[:, None], slots, kv_start, stride, stride)  # fmt: skip


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()  # (T, V)


@pytest.fixture(scope="module")
def model_dirs(tiny_dirs, tmp_path_factory):
    # Mistral with a 4-token window, so the sliding-window mask is exercised by 14-token rows.
    sw = save_tiny_model("mistral", tmp_path_factory.mktemp("sw") / "m", sliding_window=4)
    return {**tiny_dirs, "mistral-window4": sw}


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral-window4", "qwen2", "qwen3"])
def test_cached_decode_equals_full_forward(family, model_dirs):
    path = model_dirs[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, torch.float32, "cpu")
    if family == "mistral-window4":
        assert model.cfg.sliding_window == 4
    model.setup_caches(capacity_tokens=64, max_seq=64)
    # Stale values from "earlier batches" everywhere: masking must hide them exactly.
    for kv in model.kv_caches:
        kv.k.normal_(0, 100)
        kv.v.normal_(0, 100)

    seqs = [_seq(14, 0), _seq(11, 1)]
    prompt_lens = [6, 3]  # row 1 is left-padded by 5 in an 8-wide prefill, row 0 by 2
    width, n_steps = 8, 8
    stride = width + n_steps
    refs = [_hf_logits(hf, s) for s in seqs]  # (T, V) each

    logits = prefill(model, [s[:n] for s, n in zip(seqs, prompt_lens, strict=True)], width, stride)
    kv_start = torch.tensor([width - n for n in prompt_lens])
    for t in range(n_steps + 1):
        for i, n in enumerate(prompt_lens):
            torch.testing.assert_close(logits[i], refs[i][n - 1 + t], **TOL)
        if t < n_steps:
            feed = [s[n + t] for s, n in zip(seqs, prompt_lens, strict=True)]
            logits = decode(model, feed, width + t, kv_start, stride)

    # Our own uncached prefill of the whole sequences agrees with the last decode step.
    full = prefill(model, seqs, 16, 16)
    torch.testing.assert_close(full, logits, **TOL)


def test_batch_rows_do_not_interact(tiny_dirs):
    """A row's logits are the same alone and next to a row of another length."""
    model = load_model(tiny_dirs["qwen3"], torch.float32, "cpu")
    model.setup_caches(capacity_tokens=64, max_seq=64)
    a, b = _seq(9, 2), _seq(4, 3)
    alone = prefill(model, [b], 16, 16)
    both = prefill(model, [a, b], 16, 16)
    torch.testing.assert_close(both[1], alone[0], **TOL)
    # and left padding width does not matter
    torch.testing.assert_close(prefill(model, [b], 4, 16)[0], alone[0], **TOL)


def _tiny(sliding_window: int | None = None) -> Transformer:
    cfg = ModelConfig(Family.LLAMA, vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=4, intermediate_size=8, max_position_embeddings=16,
                      sliding_window=sliding_window)  # fmt: skip
    return Transformer(cfg)


def _mask(model: Transformer, slots, kv_start, kv_len) -> torch.Tensor:
    """The model's mask as (B, T, S), checking its g copies (one per query head sharing a
    kv head, folded into the query axis) are identical."""
    full = model.attention_mask(slots, kv_start, kv_len)  # (B, 1, g*T, S)
    b, t = slots.shape
    g = model.cfg.n_heads // model.cfg.n_kv_heads
    groups = full[:, 0].view(b, g, t, kv_len)
    assert g == 2 and all(torch.equal(groups[:, 0], groups[:, i]) for i in range(g))
    return groups[:, 0]


def test_attention_mask():
    slots = torch.arange(4).expand(2, 4)
    m = _mask(_tiny(), slots, torch.tensor([0, 2]), 4)  # (B, T, S)
    assert torch.equal(m[0].int(), torch.tril(torch.ones(4, 4, dtype=torch.int)))
    expected_row1 = [
        [1, 0, 0, 0],  # padding queries see only themselves
        [0, 1, 0, 0],
        [0, 0, 1, 0],  # first real token
        [0, 0, 1, 1],
    ]
    assert m[1].int().tolist() == expected_row1
    windowed = _mask(_tiny(sliding_window=2), slots, torch.tensor([0, 0]), 4)[0]
    assert windowed[3].int().tolist() == [0, 0, 1, 1]
    # a decode query at slot 5 of a 8-slot row: slots past it (stale) stay hidden
    m = _mask(_tiny(), torch.tensor([[5]]), torch.tensor([1]), 8)[0, 0]
    assert m.int().tolist() == [0, 1, 1, 1, 1, 1, 0, 0]


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
    scaling = RopeScaling() if kind == "default" else RopeScaling(
        kind=kind, **{k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    )  # fmt: skip
    ours = inv_frequencies(16, params["rope_theta"], scaling)
    assert torch.equal(ours, hf_inv.float())
