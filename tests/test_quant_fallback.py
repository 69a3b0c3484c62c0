"""int4 keeps a layer whose input width no group size divides at int8 instead of refusing the
model (issue 22), records which in the scheme, the stats and the log, and judges a
tensor-parallel rank's layers by their split widths."""

import logging

import pytest
import torch
from helpers import prompts, read_stats, run_job, write_parquet
from paged import last_logits
from tiny_models import save_tiny_model

from batchgen.model.checkpoint.loader import load_model
from batchgen.model.parallel.sharding import TPShard
from batchgen.quant import QuantScheme, quantize_model


@pytest.fixture(scope="module")
def odd_mlp(tmp_path_factory):
    """A tiny Llama whose MLP is 200 wide: 32-256 do not divide mlp.w_out's input."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("odd") / "m", intermediate_size=200)


@pytest.mark.parametrize("backend", ["torchao", "quanto"])
def test_int4_keeps_an_undividable_layer_at_int8(odd_mlp, backend, caplog):
    tokens = torch.randint(2, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = last_logits(load_model(odd_mlp), tokens.tolist())
    model = load_model(odd_mlp)
    with caplog.at_level(logging.WARNING):
        scheme = quantize_model(model, QuantScheme("int4", backend, 128), "cpu")
    assert dict(scheme.int8_layers) == {"mlp.w_out": 200}
    assert "mlp.w_out" not in dict(scheme.layer_group_sizes)
    assert "200 input features of layers.*.mlp.w_out" in caplog.text
    d = scheme.to_dict()
    assert d["int8_layers"] == {"layers.*.mlp.w_out": "200 input features"}
    assert "layers.*.mlp.w_out" not in d["group_sizes"] and len(d["modules"]) == 4
    w_out = type(model.layers[0].mlp.w_out.weight).__name__
    w_in = type(model.layers[0].mlp.w_in.weight).__name__
    assert w_out != w_in and set(d["weight_format"].split("/")) == {w_in, w_out}
    out = last_logits(model, tokens.tolist())
    err = ((out - ref).norm() / ref.norm()).item()
    assert 0 < err <= 0.12


def test_a_rank_judges_its_split_widths(tmp_path):
    # 160 = 5 x 32 splits into 80 per rank at 2 ranks, which no group size divides
    path = save_tiny_model("llama", tmp_path / "m", hidden_size=64, intermediate_size=160)
    whole = quantize_model(load_model(path), QuantScheme("int4", "torchao", 128), "cpu")
    assert not whole.int8_layers and dict(whole.layer_group_sizes)["mlp.w_out"] == 32
    rank = load_model(path, tp=TPShard(1, 2))
    scheme = quantize_model(rank, QuantScheme("int4", "torchao", 128), "cpu")
    assert dict(scheme.int8_layers) == {"mlp.w_out": 80}


def test_a_run_reports_the_int8_layers_in_its_stats(tmp_path, odd_mlp):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    flags = ("--quantize", "int4", "--quant-backend", "torchao", "--max-new-tokens", 4)
    run_job(src, out, odd_mlp, *flags)
    q = read_stats(out)["quantization"]
    assert q["method"] == "int4" and q["int8_layers"] == {
        "layers.*.mlp.w_out": "200 input features"
    }
