"""Pre-quantized checkpoints batchgen loads as stored (torchao Int8Tensor weights; fp8 ones
dequantized at load on this CPU, which has no fp8 matmul), made from the sharpened tiny
Llama: compressed-tensors' (FP8 per channel with dynamic fp8 activations, FP8 per tensor,
W8A8 int8, W8A16 int8 in groups), written by compressed-tensors itself, and fine-grained
block FP8 (`weight_scale_inv`), written as DeepSeek's and Qwen3's are. Compared with
transformers on the same checkpoint: greedy tokens, and logits to float32 rounding; one
altered scale changes the tokens, and leaving out the activations' quantization moves the
logits (negative controls)."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    STORED_NEW,
    STORED_PROMPTS,
    assert_one_line_error,
    cpu_llm,
    hf_generate,
    hf_greedy,
    hf_logits,
    make_adapter,
    prompt_file,
    read_stats,
    run_job,
    run_plan,
    stored_tokens,
)
from paged import all_logits
from quant_checkpoints import CT_SCHEMES, block_fp8, modelopt_reference
from safetensors.torch import load_file, save_file
from test_tensor_parallel import _whole_from_shards

from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.checkpoint.activation_quant import TokenQuant
from batchgen.model.checkpoint.dequantized import on_device
from batchgen.model.checkpoint.format import checkpoint_scheme
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.families.hf_config import config_from_hf, read_hf_config
from batchgen.model.families.transformer import LINEAR_LAYERS
from batchgen.model.memory import format_bytes
from batchgen.model.parallel.sharding import TPShard
from batchgen.quant import weight_bytes

PROMPTS, MAX_NEW = STORED_PROMPTS, STORED_NEW


FORMATS = (*CT_SCHEMES, "block-fp8")  # those transformers loads on the CPU


@pytest.mark.parametrize("scheme", FORMATS)
def test_greedy_tokens_and_logits_equal_transformers(scheme, ct_dirs, hf_dirs):
    d = ct_dirs(scheme)
    assert stored_tokens(d) == hf_greedy(d, PROMPTS, MAX_NEW)
    row = PROMPTS[3]
    model = load_model(d)
    # W8A8: torchao's int8 kernel multiplies x by the int8 weight, then by its scales (not by
    # the dequantized weight), and a next layer's input that moves by float32 rounding can
    # round to the neighbouring int8 step: 2.6e-3 measured, the tokens equal
    atol = 1e-2 if scheme == "w8a8" else 1e-5
    torch.testing.assert_close(all_logits(model, row), hf_logits(d, row), rtol=0, atol=atol)
    llm = cpu_llm(d)
    q = llm.quant.to_dict()
    assert q["method"] == ("int8" if scheme.startswith("w8") else "fp8")
    assert q["checkpoint"].startswith("fp8 (block" if scheme == "block-fp8" else "compressed")
    assert q["granularity"] == {
        "fp8-tensor": "per tensor",
        "fp8-static": "per tensor",
        "w8a16-group": "groups of 16",
        "block-fp8": "blocks of 16x32",
    }.get(scheme, "per channel")
    fp8 = not scheme.startswith("w8")  # this CPU has no fp8 matmul: dequantized at load
    assert q["weight_format"] == ("float32" if fp8 else "Int8Tensor")
    linears = [b.get_submodule(t).weight for b in llm.model.layers for t in LINEAR_LAYERS]
    float_bytes = cpu_llm(hf_dirs("llama")).weights_bytes_per_rank
    if fp8:  # dense float32, the float model's bytes
        assert all(type(w) is torch.nn.Parameter for w in linears)
        assert llm.weights_bytes_per_rank == float_bytes
        return
    # the decoder linears at a byte a weight (and their float32 scales), the rest float32
    n = sum(w.qdata.numel() for w in linears)
    scales = sum(w.scale.numel() * 4 for w in linears)
    assert llm.weights_bytes_per_rank == float_bytes - 3 * n + scales


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static"])
def test_without_the_activations_quantization_the_logits_move(scheme, ct_dirs):
    """The input quantization (per token, or static) is what the checkpoint computes: left
    out, the logits are 1e-3 and more away from transformers' (with it, 1e-5 above)."""
    d, row = ct_dirs(scheme), PROMPTS[3]
    model = load_model(d)
    for m in model.modules():
        if hasattr(m, "input_quant"):
            m._forward_pre_hooks.clear()
    assert (all_logits(model, row) - hf_logits(d, row)).abs().max() > 1e-3


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "w8a16-group", "block-fp8", "modelopt-fp8"])
def test_one_altered_scale_changes_the_tokens(scheme, ct_dirs, tmp_path):
    d = ct_dirs(scheme)
    want = stored_tokens(d)
    altered = tmp_path / "altered"
    altered.mkdir()
    for f in d.iterdir():
        (altered / f.name).write_bytes(f.read_bytes())
    tensors = load_file(altered / "model.safetensors")
    suffix = "weight_scale_inv" if scheme == "block-fp8" else "weight_scale"
    tensors[f"model.layers.0.self_attn.k_proj.{suffix}"] *= 2
    save_file(tensors, altered / "model.safetensors", metadata={"format": "pt"})
    assert stored_tokens(altered) != want


@pytest.mark.parametrize("scheme", ["fp8-tensor", "w8a16-group", "block-fp8"])
def test_each_rank_loads_its_slices_of_weights_and_scales(scheme, ct_dirs):
    """Two ranks' quantized weights, dequantized and put together, are the one rank's: the
    per-tensor scales of q, k, v follow their rows, the group and block scales the split
    columns."""
    d = ct_dirs(scheme)

    def dequantized(model):
        sd = {k: getattr(v, "dequantize", lambda v=v: v)() for k, v in model.state_dict().items()}
        return SimpleNamespace(cfg=model.cfg, state_dict=lambda: sd)

    full = dequantized(load_model(d))
    shards = [dequantized(load_model(d, tp=TPShard(r, 2))) for r in range(2)]
    for name, w in _whole_from_shards(full, shards).items():
        assert torch.equal(w, full.state_dict()[name]), name


@pytest.mark.parametrize("kind", ["float", "int"])
def test_token_quantization_is_compressed_tensors_own(kind):
    """TokenQuant against compressed-tensors' fake_quantize with its dynamic per-token scales,
    on inputs with a zero row and values on int8's rounding ties."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0
    x[1, 1, :3] = torch.tensor([127.5, -127.5, 0.5]) / 127.5 * 2
    args = QuantizationArgs(num_bits=8, type=kind, strategy="token", dynamic=True)
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None)
    want = fake_quantize(x, scale, zero, args)
    got = TokenQuant("fp8" if kind == "float" else "int8")(x.reshape(-1, 64)).reshape(x.shape)
    assert torch.equal(got, want)
    assert not torch.equal(got, x)


@pytest.mark.parametrize("scheme", ["fp8-static", "w8a16-group"])
def test_two_ranks_give_transformers_tokens(scheme, ct_dirs):
    """Rank processes, each with its slices, its scales and its static input scales."""
    d = ct_dirs(scheme)
    with LLM(d, device="cpu", dtype="float32", compile=False, tensor_parallel_size=2) as llm:
        got = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))]
    assert got == hf_greedy(d, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "block-fp8"])
def test_compiled_tokens_equal_transformers(scheme, ct_dirs):
    d = ct_dirs(scheme)
    assert stored_tokens(d, compile=True) == hf_greedy(d, PROMPTS, MAX_NEW)


def test_modelopt_fp8_equals_the_dequantized_reference(ct_dirs, hf_dirs):
    """ModelOpt's FP8 (hf_quant_config.json; static input scales), which transformers does not
    load on the CPU, against the model it describes built in transformers by hand."""
    d, row = ct_dirs("modelopt-fp8"), PROMPTS[3]
    ref = modelopt_reference(hf_dirs("llama"), d)
    want = [r[: r.index(1) + 1] if 1 in r else r for r in hf_generate(ref, PROMPTS, MAX_NEW, 1)]
    assert stored_tokens(d) == want
    with torch.no_grad():
        ref_logits = ref(torch.tensor([row])).logits[0]
    torch.testing.assert_close(all_logits(load_model(d), row), ref_logits, rtol=0, atol=1e-5)
    assert "modelopt FP8" in cpu_llm(d).quant.to_dict()["checkpoint"]


def test_blocks_that_do_not_tile_a_weight_are_refused(hf_dirs, tmp_path):
    d = block_fp8(hf_dirs("llama"), tmp_path / "b", block=(16, 48))  # 48 divides no width
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", d, exit_code=2)
    assert_one_line_error(r, "hidden 64", "not a whole number of 48-column scale blocks")


@pytest.mark.parametrize("scheme", ["fp8-static", "block-fp8", "modelopt-fp8"])
def test_fp8_on_the_cpu_is_dequantized_at_load_in_one_line(scheme, ct_dirs, caplog):
    """No fp8 matmul on the CPU: each fp8 linear a dense float32 weight (q * scale), the
    static input scales still applied, said in one line with the resident bytes."""
    with caplog.at_level("WARNING"):
        model = load_model(ct_dirs(scheme))
    for b in model.layers:
        for t in LINEAR_LAYERS:
            w = b.get_submodule(t).weight
            assert type(w) is torch.nn.Parameter and w.dtype == torch.float32, t
            assert hasattr(b.get_submodule(t), "input_quant") == (scheme != "block-fp8")
    lines = [r.getMessage() for r in caplog.records if "fp8 matmul" in r.getMessage()]
    assert len(lines) == 1, lines
    assert (
        "cpu has no fp8 matmul, so the fp8 weights are dequantized at load to float32" in (lines[0])
    )
    assert lines[0].endswith(f"the weights take {format_bytes(weight_bytes(model))}")


def test_on_cuda_fp8_stays_float8_tensors_with_the_same_logits(ct_dirs):
    """The stored path a GPU keeps (sm89+ has fp8 matmuls; its load runs on the host):
    Float8Tensor weights, giving the logits the dequantized CPU load gives."""
    d, row = ct_dirs("fp8-dynamic"), PROMPTS[3]
    hf = read_hf_config(d, native=False)
    stored = checkpoint_scheme(d, hf)
    assert on_device(stored, "cuda") is stored and on_device(stored, "cpu").dequantized
    w8 = ct_dirs("w8a16-group")
    int8 = checkpoint_scheme(w8, read_hf_config(w8, native=False))
    assert on_device(int8, "cpu") is int8  # an int8 kernel runs on the CPU
    kept = load_model(d, cfg=config_from_hf(hf), stored=on_device(stored, "cuda"))
    assert type(kept.layers[0].attn.wqkv.weight).__name__ == "Float8Tensor"
    want = all_logits(load_model(d), row)
    torch.testing.assert_close(all_logits(kept, row), want, rtol=0, atol=1e-5)


def test_fp8_dynamic_as_a_gpus_fp8_gemm_gives_the_checkpoints_logits(ct_dirs):
    """The path an sm90+ GPU takes for FP8_DYNAMIC, built and run here (torch._scaled_mm has
    a CPU kernel): each linear a Float8Tensor that quantizes its input per token itself, no
    TokenQuant hook, and the logits of the dequantized load with its fake-quantized inputs.
    Without the input quantization the logits move (the control)."""
    d, row = ct_dirs("fp8-dynamic"), PROMPTS[3]
    hf = read_hf_config(d, native=False)
    stored = checkpoint_scheme(d, hf)
    assert not on_device(stored, "cuda").fp8_gemm  # no GPU here: the device says no
    gemm = on_device(stored, "cuda", fp8_gemm=True)
    assert gemm.fp8_gemm and gemm.describe().endswith("; fp8 x fp8 GEMM")
    st = ct_dirs("fp8-static")
    static = checkpoint_scheme(st, read_hf_config(st, native=False))
    assert not on_device(static, "cuda", fp8_gemm=True).fp8_gemm  # static scales: weight-only
    model = load_model(d, cfg=config_from_hf(hf), stored=gemm)
    w = model.layers[0].attn.wqkv.weight
    assert type(w).__name__ == "Float8Tensor" and w.act_quant_kwargs is not None
    assert not any(isinstance(m, TokenQuant) for m in model.modules())
    want = all_logits(load_model(d), row)
    torch.testing.assert_close(all_logits(model, row), want, rtol=0, atol=1e-5)
    for b in model.layers:
        for t in LINEAR_LAYERS:
            b.get_submodule(t).weight.act_quant_kwargs = None
    assert (all_logits(model, row) - want).abs().max() > 1e-3


def test_run_records_the_checkpoints_scheme_and_bytes(ct_dirs, hf_dirs, tmp_path):
    src = prompt_file(tmp_path, 2)
    run_job(src, tmp_path / "out", ct_dirs("w8a8"), "--max-new-tokens", 4)
    stats = read_stats(tmp_path / "out")
    assert "int-quantized" in stats["quantization"]["checkpoint"]
    assert stats["weights_bytes_per_rank"] == cpu_llm(ct_dirs("w8a8")).weights_bytes_per_rank
    # plan counts the linears at a byte a weight (their scales and the norms aside)
    plan = json.loads(run_plan(src, ct_dirs("w8a8"), "--json").stdout)
    model = load_model(ct_dirs("w8a8"))
    scales = sum(p.scale.numel() * 4 for p in model.parameters() if hasattr(p, "scale"))
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert plan["weights_bytes_per_rank"] == stats["weights_bytes_per_rank"] - scales - norms
    assert "int-quantized" in plan["weights_stored_as"]


def test_quantize_and_lora_are_refused(ct_dirs, hf_dirs, tmp_path):
    """(The transformers backend loads this checkpoint: tests/test_hf_quant_stored.py.)"""
    import peft

    d, src = ct_dirs("fp8-dynamic"), prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "o1", d, "--quantize", "int8", exit_code=2)
    assert_one_line_error(r, "already quantized", "drop --quantize int8")
    adapter = tmp_path / "adapter"  # made on the float model the checkpoint was made from
    make_adapter(hf_dirs("llama"), adapter, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    r = run_job(src, tmp_path / "o3", d, "--lora", adapter, exit_code=2)
    assert_one_line_error(r, "LoRA adapter cannot be merged", "unquantized release")


def test_fp8_runs_record_the_dequantized_bytes(ct_dirs, hf_dirs, tmp_path):
    """stats.json, the roofline and plan count what is resident: the float32 linears."""
    src, d = prompt_file(tmp_path, 2), ct_dirs("fp8-dynamic")
    run_job(src, tmp_path / "out", d, "--max-new-tokens", 4)
    stats = read_stats(tmp_path / "out")
    model = cpu_llm(hf_dirs("llama")).model
    assert stats["weights_bytes_per_rank"] == weight_bytes(model)
    lookup = 0 if model.lm_head.weight is model.embed.weight else model.embed.weight.numel() * 4
    assert stats["weights_read_bytes"] == stats["weights_bytes_per_rank"] - lookup
    plan = json.loads(run_plan(src, d, "--json").stdout)
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert plan["weights_bytes_per_rank"] == stats["weights_bytes_per_rank"] - norms
    assert "dequantized at load (no fp8 matmul here)" in plan["weights_stored_as"]
    (line,) = [n for n in plan["load_notes"] if "fp8 matmul" in n]
    assert "cpu has no fp8 matmul, so the fp8 weights are dequantized at load" in line
