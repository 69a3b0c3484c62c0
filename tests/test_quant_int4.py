"""INT4 weight-only checkpoints loaded as stored (model/checkpoint/int4_formats.py,
int4_tensors.py), made from the sharpened tiny Llama: compressed-tensors pack-quantized W4A16
(groups, channel, zero points), written by compressed-tensors itself and compared with its own
decompression (and, symmetric, with transformers on the same checkpoint); GPTQ (v1 and v2 zero
points, act-order) and AWQ GEMM, written by hand as their packers write them (int4_checkpoints.py)
and compared with the float model they describe. One altered scale changes the tokens;
variants batchgen does not load are refused in one line before any weight is read."""

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
    hf_logits,
    make_adapter,
    prompt_file,
    read_stats,
    run_job,
    run_plan,
    stored_tokens,
)
from int4_checkpoints import ct_reference, with_config, write_int4
from paged import all_logits
from quant_checkpoints import CT_INT4, compress
from safetensors.torch import load_file, save_file

from batchgen.engine.sequence import SamplingParams
from batchgen.errors import ModelLoadError
from batchgen.llm import LLM
from batchgen.model.checkpoint.int4_formats import Int4Layout
from batchgen.model.checkpoint.int4_tensors import unpack_layer
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.families.transformer import LINEAR_LAYERS
from batchgen.model.parallel.sharding import TPShard

PROMPTS, MAX_NEW = STORED_PROMPTS, STORED_NEW
# name -> write_int4's arguments
HAND = {
    "gptq": dict(method="gptq"),
    "gptq-sym-v2": dict(method="gptq", sym=True, v2=True),
    "gptq-act-order": dict(method="gptq", sym=True, act_order=True),
    "gptq-channel": dict(method="gptq", group=-1),
    "awq": dict(method="awq"),
    # groups of 16, which tinygemm's CPU kernel does not take: kept as Int8Tensor of q - z
    "gptq-group16": dict(method="gptq", group=16),
}


@pytest.fixture(scope="module")
def int4_dirs(hf_dirs, tmp_path_factory):
    """name of CT_INT4 or HAND -> (checkpoint, the float model it describes)."""
    root = tmp_path_factory.mktemp("int4")

    def make(name: str):
        if name in CT_INT4:
            pytest.importorskip("compressed_tensors")
            d = compress(hf_dirs("llama"), root / name, name)
            return d, ct_reference(hf_dirs("llama"), d, CT_INT4[name])
        return write_int4(hf_dirs("llama"), root / name, **HAND[name])

    return cached(make)


@pytest.mark.parametrize("name", [*CT_INT4, *HAND])
def test_greedy_tokens_and_logits_equal_the_reference(name, int4_dirs):
    d, ref = int4_dirs(name)
    assert stored_tokens(d) == hf_greedy(ref, PROMPTS, MAX_NEW)
    if name in ("w4a16-group", "w4a16-channel"):  # transformers loads these right
        assert stored_tokens(d) == hf_greedy(d, PROMPTS, MAX_NEW)
    row = PROMPTS[3]
    # tinygemm computes (q' - 8) s + m, not (q - z) s: float32 rounding apart
    torch.testing.assert_close(
        all_logits(load_model(d), row), hf_logits(ref, row), rtol=0, atol=1e-4
    )
    q = cpu_llm(d).quant.to_dict()
    assert q["method"] == "int4"
    # act-order: dequantized at load, float weights
    formats = {"gptq-act-order": "float32", "gptq-group16": "Int8Tensor"}
    assert q["weight_format"] == formats.get(name, "Int4OpaqueTensor")
    assert q["granularity"] == {
        "w4a16-channel": "per channel",
        "gptq-channel": "per channel",
        "gptq-act-order": "groups of 32, act-order",
        "gptq-group16": "groups of 16",
    }.get(name, "groups of 32")


SAID = {"gptq-act-order": "dequantized at load to float32", "gptq-group16": "kept as int8 q - z"}


@pytest.mark.parametrize(("name", "said"), SAID.items())
def test_layers_not_kept_at_4_bits_are_said_in_one_line(name, said, int4_dirs, caplog):
    with caplog.at_level("WARNING"):
        cpu_llm(int4_dirs(name)[0])
    assert len([r for r in caplog.records if said in r.getMessage()]) == 1
    assert said in caplog.text


def test_lora_and_the_transformers_backend_are_refused(int4_dirs, hf_dirs, tmp_path):
    import peft

    d, src = int4_dirs("gptq")[0], prompt_file(tmp_path, 2)
    adapter = tmp_path / "adapter"  # made on the float model the checkpoint was made from
    make_adapter(hf_dirs("llama"), adapter, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    r = run_job(src, tmp_path / "o1", d, "--lora", adapter, exit_code=2)
    assert_one_line_error(r, "LoRA adapter cannot be merged", "gptq", "unquantized release")
    r = run_job(src, tmp_path / "o2", d, "--model-impl", "transformers", exit_code=2)
    assert_one_line_error(r, "gptq")


@pytest.mark.parametrize(
    ("name", "scale"), [("w4a16-group", "weight_scale"), ("gptq", "scales"), ("awq", "scales")]
)
def test_one_altered_scale_changes_the_tokens(name, scale, int4_dirs, tmp_path):
    d, _ = int4_dirs(name)
    want = stored_tokens(d)
    altered = tmp_path / "altered"
    shutil.copytree(d, altered)
    tensors = load_file(altered / "model.safetensors")
    tensors[f"model.layers.0.self_attn.k_proj.{scale}"] *= 2
    save_file(tensors, altered / "model.safetensors", metadata={"format": "pt"})
    assert stored_tokens(altered) != want


@pytest.mark.parametrize("name", ["gptq", "w4a16-asym"])
def test_two_ranks_give_the_references_tokens(name, int4_dirs):
    """Each rank unpacks its layers and takes its rows, or its columns' groups (the attention
    output's 32 and the MLP's 64 input columns a rank: whole groups of 32), with their
    scales and zero points."""
    d, ref = int4_dirs(name)
    with LLM(d, device="cpu", dtype="float32", compile=False, tensor_parallel_size=2) as llm:
        got = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))]
    assert got == hf_greedy(ref, PROMPTS, MAX_NEW)


def test_compiled_tokens_equal_the_reference(int4_dirs):
    d, ref = int4_dirs("awq")
    assert stored_tokens(d, compile=True) == hf_greedy(ref, PROMPTS, MAX_NEW)


def _actorder_group(q: dict) -> dict:
    group = json.loads(json.dumps(q["config_groups"]["group_0"]))
    group["weights"]["actorder"] = "group"
    return {"config_groups": {"group_0": group}}


# (fixture, quantization_config changes, words the refusal names)
VARIANTS = {
    "gptq-3bit": ("gptq", dict(bits=3), ("gptq (3-bit",)),
    "gptq-marlin": ("gptq", dict(checkpoint_format="marlin"), ("gptq", "marlin format")),
    "gptq-lm-head": ("gptq", dict(lm_head=True), ("gptq (4-bit",)),
    "awq-gemv": ("awq", dict(version="gemv"), ("awq", "gemv")),
    "awq-marlin": ("awq", dict(version="marlin"), ("awq", "marlin")),
    "awq-no-zero-point": ("awq", dict(zero_point=False), ("awq", "gemm")),
    "ct-actorder-group": ("w4a16-group", _actorder_group, ("pack-quantized", "4-bit int")),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_unsupported_int4_variants_are_refused_before_any_weight_is_read(
    variant, int4_dirs, tmp_path
):
    """The weights file is garbage: a refusal that read it would say so instead."""
    name, changes, words = VARIANTS[variant]
    d, _ = int4_dirs(name)
    if callable(changes):
        changes = changes(json.loads((d / "config.json").read_text())["quantization_config"])
    bad = with_config(d, tmp_path / variant, **changes)
    (bad / "model.safetensors").write_bytes(b"not a weights file")
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", bad, exit_code=2)
    assert_one_line_error(r, "pre-quantized", *words, "--quantize")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_resident_bytes_are_the_checkpoints_and_plan_counts_half_a_byte(
    int4_dirs, hf_dirs, tmp_path
):
    """stats.json's weights_bytes_per_rank (and the roofline's weights_read_bytes, from it):
    the float model's, less the linears' float32
    weights, plus the int4 tensors: their packed weights are the checkpoint's qweight bytes
    exactly; their scales and float zero points, a float32 pair per group and output (8
    bytes where GPTQ keeps 2 + 0.5 in fp16 and packed int4), are what makes the resident
    linears up to 8 / 2.5 times the checkpoint's scale bytes: 1.35x its linears' bytes at
    groups of 32 in float32 (1.1x in bf16; 1.05x at the usual groups of 128)."""
    d, _ = int4_dirs("gptq")
    src = prompt_file(tmp_path, 2)
    run_job(src, tmp_path / "out", d, "--max-new-tokens", 4)
    stats = read_stats(tmp_path / "out")
    llm = cpu_llm(d)
    assert stats["weights_bytes_per_rank"] == llm.weights_bytes_per_rank
    linears = [b.get_submodule(t).weight for b in llm.model.layers for t in LINEAR_LAYERS]
    n = sum(w.numel() for w in linears)
    stored = load_file(d / "model.safetensors")
    packed = sum(v.numel() * 4 for k, v in stored.items() if k.endswith(".qweight"))
    assert sum(w.qdata.numel() for w in linears) == packed == n // 2
    pairs = sum(w.scale_and_zero.numel() * 4 for w in linears)
    float_bytes = cpu_llm(hf_dirs("llama")).weights_bytes_per_rank
    assert stats["weights_bytes_per_rank"] == float_bytes - 4 * n + packed + pairs
    quantized = sum(
        v.numel() * v.element_size()
        for k, v in stored.items()
        if "layers" in k and not k.endswith("norm.weight")
    )
    assert packed + pairs <= 1.36 * quantized
    # the roofline's bytes a decode step reads: the same resident bytes, less a lookup table
    m = llm.model
    lookup = 0 if m.lm_head.weight is m.embed.weight else m.embed.weight.numel() * 4
    assert stats["weights_read_bytes"] == stats["weights_bytes_per_rank"] - lookup
    plan = json.loads(run_plan(src, d, "--json").stdout)
    norms = sum(p.numel() * 4 for k, p in llm.model.named_parameters() if "norm" in k)
    assert plan["weights_bytes_per_rank"] == stats["weights_bytes_per_rank"] - pairs - norms
    assert "gptq" in plan["weights_stored_as"]


def test_a_gpt2_int4_checkpoint_is_refused(tiny_dirs, tmp_path):
    d = tmp_path / "gpt2-gptq"
    shutil.copytree(tiny_dirs["gpt2"], d)
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (d / "config.json").write_text(json.dumps(hf))
    r = run_job(prompt_file(tmp_path, 2), tmp_path / "out", d, exit_code=2)
    assert_one_line_error(r, "GPT-2 model (Conv1D layers)", "--quantize")


def test_packing_orders_are_the_formats_own():
    """One word per format, written from its packer's source: AutoGPTQ's `pack` puts input
    row 8r + k in nibble k of qweight[r] (and zero points minus 1); AutoAWQ's GEMM packer
    puts output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] in nibble i of qweight[:, c]."""
    ones = torch.ones(1, 8, dtype=torch.float16)
    gptq = Int4Layout("gptq", "gptq", 8, False, zero_offset=1)
    words = torch.full((1, 8), 0x76543210, dtype=torch.int32)  # (in/8, out)
    zeros = torch.full((1, 1), 0x77777777, dtype=torch.int32)  # z = 7 + 1
    parts = {"qweight": words, "qzeros": zeros, "scales": ones}
    d = unpack_layer(gptq, parts, "gptq", torch.float32)["gptq.weight"]  # (out, in)
    assert torch.equal(d, (torch.arange(8) - 8).to(torch.int8).expand(8, 8))
    awq = Int4Layout("awq", "awq", 8, False)
    words = torch.full((8, 1), 0x75316420, dtype=torch.int32)  # (in, out/8)
    parts = {"qweight": words, "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": ones}
    d = unpack_layer(awq, parts, "awq", torch.float32)["awq.weight"]
    assert torch.equal(d, torch.arange(8, dtype=torch.int8)[:, None].expand(8, 8))


def test_a_rank_split_inside_a_group_is_refused_before_loading(hf_dirs, tmp_path):
    """Groups of 64: two ranks would split the attention output's 64 input columns at 32."""
    d, _ = write_int4(hf_dirs("llama"), tmp_path / "g64", "gptq", group=64)
    (d / "model.safetensors").write_bytes(b"not a weights file")
    with pytest.raises(ModelLoadError, match="attention output 32.*64-column scale blocks"):
        load_model(d, tp=TPShard(0, 2))
