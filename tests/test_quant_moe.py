"""Pre-quantized MoE checkpoints (Qwen3-MoE, Mixtral; one linear per expert): the experts
(and a router a tool quantized) are dequantized at load into the stacked expert tensors, the
attention stays as stored, said in one line (model/checkpoint/dequantized.py). Made from the
sharpened tiny models as GPTQ, AWQ, compressed-tensors W4A16 and FP8, and block FP8
(moe_checkpoints.py); greedy float32 tokens through the engine equal transformers' on the
float model each describes, and one altered expert scale changes them. The layouts not
loaded (experts stored 3-D, experts with quantized inputs) are refused in one line before any
weight is read, by `batchgen plan` too."""

import json
import shutil

import pytest
import torch
from helpers import (
    STORED_NEW,
    STORED_PROMPTS,
    assert_one_line_error,
    cached,
    cpu_llm,
    hf_greedy,
    prompt_file,
    read_stats,
    run_job,
    run_plan,
    stored_tokens,
)
from moe_checkpoints import stack_experts, write_moe
from safetensors.torch import load_file, save_file

from batchgen.engine.sequence import SamplingParams
from batchgen.model.families.transformer import LINEAR_LAYERS

PROMPTS, MAX_NEW = STORED_PROMPTS, STORED_NEW
CASES = [
    ("qwen3_moe", "gptq"),
    ("qwen3_moe", "awq"),
    ("qwen3_moe", "ct-w4a16"),
    ("qwen3_moe", "ct-fp8"),
    ("qwen3_moe", "ct-fp8-router"),
    ("qwen3_moe", "block-fp8"),
    ("mixtral", "gptq"),
    ("mixtral", "ct-fp8"),
]
ATTENTION = [t for t in LINEAR_LAYERS if t.startswith("attn.")]


@pytest.fixture(scope="module")
def moe_dirs(hf_dirs, tmp_path_factory):
    """(family, format) -> (checkpoint, the float model it describes)."""
    root = tmp_path_factory.mktemp("moe")

    def make(key: tuple[str, str]):
        family, fmt = key
        router = fmt.endswith("-router")
        src = hf_dirs(family)
        return write_moe(src, root / f"{family}-{fmt}", family, fmt.removesuffix("-router"), router)

    made = cached(make)
    return lambda family, fmt: made((family, fmt))


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_tokens_equal_the_dequantized_reference(family, fmt, moe_dirs, caplog):
    d, ref = moe_dirs(family, fmt)
    with caplog.at_level("WARNING"):
        llm = cpu_llm(d)
    got = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))]
    assert got == hf_greedy(ref, PROMPTS, MAX_NEW)
    for b in llm.model.layers:  # experts and router: dense float32 parameters
        for w in (b.mlp.w_in, b.mlp.w_out, b.mlp.router.weight):
            assert type(w) is torch.nn.Parameter and w.dtype == torch.float32
    int4 = "fp8" not in fmt
    kept = {type(llm.model.layers[0].get_submodule(t).weight).__name__ for t in ATTENTION}
    # the attention as stored: int4 in tinygemm's tensor; fp8, on this CPU, dequantized too
    assert kept == ({"Int4OpaqueTensor"} if int4 else {"Parameter"})
    lines = [r.getMessage() for r in caplog.records if "dequantized at load to" in r.getMessage()]
    assert len(lines) == 1, lines
    if int4:
        assert "no grouped int4 expert kernel here, so the MoE experts are dequantized" in lines[0]
    else:
        assert "cpu has no fp8 matmul" in lines[0]
    assert llm.quant.to_dict()["unquantized"] == ["layers.0.mlp", "layers.1.mlp"]


@pytest.mark.parametrize(("fmt", "scale"), [("gptq", "scales"), ("ct-fp8", "weight_scale")])
def test_one_altered_expert_scale_changes_the_tokens(fmt, scale, moe_dirs, tmp_path):
    d, _ = moe_dirs("qwen3_moe", fmt)
    want = stored_tokens(d)
    altered = tmp_path / "altered"
    shutil.copytree(d, altered)
    tensors = load_file(altered / "model.safetensors")
    tensors[f"model.layers.0.mlp.experts.1.down_proj.{scale}"] *= 2
    save_file(tensors, altered / "model.safetensors", metadata={"format": "pt"})
    assert stored_tokens(altered) != want


def test_stats_and_plan_count_the_float_experts(moe_dirs, tmp_path):
    """Resident: the attention's packed int4 and scale pairs, the experts and router float32;
    plan counts the attention at half a byte a weight and the experts at the dtype's bytes."""
    d, _ = moe_dirs("qwen3_moe", "gptq")
    src = prompt_file(tmp_path, 2)
    run_job(src, tmp_path / "out", d, "--max-new-tokens", 4)
    stats = read_stats(tmp_path / "out")
    llm = cpu_llm(d)
    assert stats["weights_bytes_per_rank"] == llm.weights_bytes_per_rank
    attn = [b.get_submodule(t).weight for b in llm.model.layers for t in ATTENTION]
    pairs = sum(w.scale_and_zero.numel() * 4 for w in attn)
    norms = sum(p.numel() * 4 for k, p in llm.model.named_parameters() if "norm" in k)
    plan = json.loads(run_plan(src, d, "--json").stdout)
    assert plan["weights_bytes_per_rank"] == stats["weights_bytes_per_rank"] - pairs - norms
    (line,) = [n for n in plan["load_notes"] if "dequantized at load" in n]
    assert "MoE experts are dequantized at load to float32 (the other linears stay int4)" in line


def test_experts_stored_3d_are_refused_in_one_line(hf_dirs, tmp_path):
    d = stack_experts(hf_dirs("qwen3_moe"), tmp_path / "stacked")
    src = prompt_file(tmp_path, 2)
    words = ("experts stored 3-D", "fp8 (block scales", "layers.0.mlp.experts.", "bf16 release")
    assert_one_line_error(run_job(src, tmp_path / "out", d, exit_code=2), *words)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert_one_line_error(run_plan(src, d, exit_code=2), *words[:2])


FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_with_quantized_inputs_are_refused_before_any_weight_is_read(
    family, hf_dirs, tmp_path
):
    """The weights file is garbage: a refusal that read it would say so."""
    d = tmp_path / family
    shutil.copytree(hf_dirs(family), d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "quantization_config": FP8_DYNAMIC}))
    (d / "model.safetensors").write_bytes(b"not a weights file")
    src = prompt_file(tmp_path, 2)
    words = ("MoE model's experts", "with quantized inputs", "dynamic per token", "bf16 release")
    assert_one_line_error(run_job(src, tmp_path / "out", d, exit_code=2), *words)
    assert_one_line_error(run_plan(src, d, exit_code=2), *words[:2])
