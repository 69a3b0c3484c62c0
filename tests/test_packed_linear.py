"""oneDNN-packed weights (model/families/packed_linear.py): eager float32 on the CPU packs every
decoder linear and an untied LM head once at load; the logits equal the plain layers', and
the paths that cannot take a packed weight (compile, quantized weights, a tied head, the
switch off) keep plain ones. Token equality with transformers through the packed layers is
tests/test_exactness.py's (it runs the default CPU path)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.families.packed_linear import (
    PACKED_WEIGHTS_ENV,
    PackedGatedMLP,
    PackedLinear,
    can_pack,
    pack_linears,
)
from batchgen.model.families.transformer import MLP

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN"
)


def _packed_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_a_packed_gated_mlp_equals_the_fused_one(rows):
    """Its [gate; up] weight and bias split in two packed layers, the same outputs."""
    g = torch.Generator().manual_seed(rows)
    cfg = SimpleNamespace(
        dim=64, intermediate_size=96, gated_mlp=True, activation="silu", mlp_bias=True
    )
    mlp = MLP(cfg)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    packed = PackedGatedMLP(mlp)
    assert [m.out_features for m in (packed.w_gate, packed.w_up, packed.w_out)] == [96, 96, 64]
    x = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(packed(x), mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_equals_the_plain_layer(rows):
    g = torch.Generator().manual_seed(rows)
    plain = nn.Linear(96, 200, bias=True)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(200, 96, generator=g))
        plain.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g)
    packed = PackedLinear(plain)
    torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-4)
    assert packed.weight.shape == plain.weight.shape and packed.weight.is_mkldnn
    # a non-contiguous input (a column slice) reads the same
    wide = torch.randn(rows, 192, generator=g)[:, ::2]
    torch.testing.assert_close(packed(wide), plain(wide), rtol=1e-5, atol=1e-4)


def test_a_column_major_lm_head_packs_to_the_same_product():
    w = torch.randn(300, 64)
    head = nn.Linear(64, 300, bias=False)
    head.weight = nn.Parameter(w.t().contiguous().t())  # the loader's CPU layout
    x = torch.randn(7, 64)
    torch.testing.assert_close(PackedLinear(head)(x), x @ w.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_packing_a_loaded_model_keeps_its_logits(tiny_dirs, family):
    plain = load_model(tiny_dirs[family], torch.float32, torch.device("cpu"))
    packed = load_model(tiny_dirs[family], torch.float32, torch.device("cpu"))
    n = pack_linears(packed)
    tied = plain.cfg.tie_embeddings
    per_layer = 5 if plain.cfg.gated_mlp else 4  # a gated MLP's gate and up: two weights
    assert n == per_layer * plain.cfg.n_layers + (0 if tied else 1)
    assert ("lm_head" in _packed_layers(packed)) is not tied
    x = torch.randn(11, plain.cfg.dim)
    for a, b in zip(plain.layers, packed.layers, strict=True):
        torch.testing.assert_close(b.mlp(x), a.mlp(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.lm_head(x), plain.lm_head(x), rtol=1e-5, atol=1e-5)


def test_the_default_cpu_path_packs_and_generates_what_the_plain_one_does(model, monkeypatch):
    prompts = [[5, 9, 13, 2, 7], [3, 4], list(range(20, 60))]
    with LLM(model, device="cpu", dtype="float32") as llm:
        layers = _packed_layers(llm.model)
        assert len(layers) >= 4 * llm.model.cfg.n_layers
        packed = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    monkeypatch.setenv(PACKED_WEIGHTS_ENV, "0")
    with LLM(model, device="cpu", dtype="float32") as llm:
        assert _packed_layers(llm.model) == []
        plain = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in packed] == [o.token_ids for o in plain]


@pytest.mark.parametrize(
    "options",
    [
        {"dtype": "bfloat16"},
        {"dtype": "float32", "compile": True},
        {"dtype": "float32", "quantize": "int8"},
    ],
    ids=["bf16", "compile", "int8"],
)
def test_paths_that_cannot_take_a_packed_weight_keep_plain_layers(model, options):
    with LLM(model, device="cpu", **options) as llm:
        assert _packed_layers(llm.model) == []
