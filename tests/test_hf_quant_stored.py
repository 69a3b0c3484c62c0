"""Pre-quantized checkpoints on the transformers backend (`--model-impl transformers`): the
formats transformers' own quantizer loads right on this CPU (compressed-tensors FP8, INT8 and
symmetric W4A16, with compressed-tensors installed; block FP8, which it dequantizes) load
through it, decompressed at load. Their greedy float32 tokens on mixed-length prompts equal
transformers' own generate on the same checkpoint and the native implementation's; one altered
scale changes them (the control). stats, plan and the quant description count and name the
float weights. The formats left out are refused in one line, exit 2, before any weight is
read (the checkpoints' weight files are made unreadable to show it)."""

import json
import shutil

import pytest
import torch
from helpers import (
    STORED_NEW,
    STORED_PROMPTS,
    assert_one_line_error,
    cpu_llm,
    hf_greedy,
    prompt_file,
    read_stats,
    run_job,
    run_plan,
    stored_tokens,
)
from int4_checkpoints import write_int4
from quant_checkpoints import declare_format
from safetensors.torch import load_file, save_file

from batchgen.engine.sequence import SamplingParams
from batchgen.model.hf import refusal
from batchgen.model.memory import format_bytes

PROMPTS, MAX_NEW = STORED_PROMPTS, STORED_NEW
LOADED = (
    "fp8-dynamic",
    "fp8-tensor",
    "fp8-static",
    "w8a8",
    "w8a16-group",
    "w4a16-group",
    "w4a16-channel",
    "block-fp8",
)
BACKEND = {"model_impl": "transformers"}


def _extra_bytes(llm) -> int:
    """Bytes of the parameters that are not a weight or bias: the scales (and zero points)
    compressed-tensors keeps on each decompressed layer."""
    params = llm.model.named_parameters()
    return sum(
        p.numel() * p.element_size()
        for n, p in params
        if n.rsplit(".", 1)[-1] not in ("weight", "bias")
    )


@pytest.mark.parametrize("scheme", LOADED)
def test_greedy_tokens_equal_transformers_and_native(scheme, ct_dirs, hf_dirs, caplog):
    d = ct_dirs(scheme)
    with caplog.at_level("WARNING"):
        llm = cpu_llm(d, **BACKEND)
    assert type(llm.model).__name__ == "HFModel"
    got = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))]
    assert got == hf_greedy(d, PROMPTS, MAX_NEW)
    assert got == stored_tokens(d, model_impl="native")
    # every linear a dense float32 weight: transformers decompressed them at load
    linears = [m for m in llm.model.hf.modules() if isinstance(m, torch.nn.Linear)]
    assert all(type(m.weight) is torch.nn.Parameter for m in linears)
    assert all(m.weight.dtype == torch.float32 for m in linears)
    q = llm.quant.to_dict()
    assert q["backend"] == "transformers" and q["weight_format"] == "float32"
    assert q["method"] == {"w8": "int8", "w4": "int4"}.get(scheme[:2], "fp8")
    assert q["checkpoint"].endswith("; decompressed at load by transformers")
    float_bytes = cpu_llm(hf_dirs("llama"), **BACKEND).weights_bytes_per_rank
    assert llm.weights_bytes_per_rank == float_bytes + _extra_bytes(llm)
    lines = [r.getMessage() for r in caplog.records if "decompresses" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "transformers decompresses the stored weights at load to float32" in lines[0]
    assert lines[0].endswith(f"the weights take {format_bytes(llm.weights_bytes_per_rank)}")


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "w8a16-group", "w4a16-group", "block-fp8"])
def test_one_altered_scale_changes_the_tokens(scheme, ct_dirs, tmp_path):
    d = ct_dirs(scheme)
    want = stored_tokens(d, **BACKEND)
    altered = shutil.copytree(d, tmp_path / "altered")
    tensors = load_file(altered / "model.safetensors")
    suffix = "weight_scale_inv" if scheme == "block-fp8" else "weight_scale"
    tensors[f"model.layers.0.self_attn.k_proj.{suffix}"] *= 2
    save_file(tensors, altered / "model.safetensors", metadata={"format": "pt"})
    assert stored_tokens(altered, **BACKEND) != want


def test_run_and_plan_count_the_decompressed_float_weights(ct_dirs, hf_dirs, tmp_path):
    src, d = prompt_file(tmp_path, 2), ct_dirs("w8a8")
    flags = ("--model-impl", "transformers")
    run_job(src, tmp_path / "out", d, "--max-new-tokens", 4, *flags)
    stats = read_stats(tmp_path / "out")
    assert stats["model_impl"] == "transformers"
    assert stats["quantization"]["backend"] == "transformers"
    assert stats["quantization"]["weight_format"] == "float32"
    llm = cpu_llm(d, **BACKEND)
    assert stats["weights_bytes_per_rank"] == llm.weights_bytes_per_rank
    plan = json.loads(run_plan(src, d, "--json", *flags).stdout)
    # the float model's bytes (the scales left out, as natively)
    float_plan = json.loads(run_plan(src, hf_dirs("llama"), "--json", *flags).stdout)
    assert plan["weights_bytes_per_rank"] == float_plan["weights_bytes_per_rank"]
    assert plan["weights_bytes_per_rank"] == llm.weights_bytes_per_rank - _extra_bytes(llm)
    assert plan["weights_stored_as"].endswith("decompressed at load by transformers")
    (line,) = [n for n in plan["load_notes"] if "decompresses" in n]
    assert "transformers decompresses the stored weights at load to float32" in line


def _unreadable(d, dst):
    """dst: d's checkpoint with its weight file replaced by bytes no reader takes."""
    shutil.copytree(d, dst)
    (dst / "model.safetensors").write_bytes(b"\0" * 64)
    return dst


def test_formats_left_out_are_refused_before_any_weight_is_read(ct_dirs, hf_dirs, tmp_path):
    src = prompt_file(tmp_path, 2)
    llama = hf_dirs("llama")
    refused = {  # checkpoint -> words of its one line
        "asym": (ct_dirs("w4a16-asym"), ("zero points", "mis-sizes", "native")),
        "gptq": (
            write_int4(llama, tmp_path / "g", method="gptq")[0],
            ("pre-quantized (gptq)", "native"),
        ),
        "awq": (
            write_int4(llama, tmp_path / "a", method="awq")[0],
            ("pre-quantized (awq)", "native"),
        ),
        "kv-cache": (declare_format(llama, tmp_path / "kv", "ct-fp8-kv-cache"), ("does not load",)),
    }
    for name, (d, words) in refused.items():
        d = _unreadable(d, tmp_path / f"{name}-unreadable")
        out = tmp_path / f"out-{name}"
        r = run_job(src, out, d, "--model-impl", "transformers", exit_code=2)
        assert_one_line_error(r, *words)
        assert not out.exists() or not any(out.iterdir())
        r = run_plan(src, d, "--model-impl", "transformers", exit_code=2)
        assert_one_line_error(r, *words)


def test_without_compressed_tensors_it_is_refused_naming_what_to_install(
    ct_dirs, tmp_path, monkeypatch
):
    d = _unreadable(ct_dirs("fp8-dynamic"), tmp_path / "ct")
    monkeypatch.setitem(refusal.DECOMPRESSED, "compressed-tensors", "batchgen_absent_module")
    r = run_job(
        prompt_file(tmp_path, 2), tmp_path / "out", d, "--model-impl", "transformers", exit_code=2
    )
    assert_one_line_error(r, "pip install compressed-tensors", "--model-impl native")


@pytest.mark.parametrize(("model_type", "words"), [("qwen3_moe", "MoE"), ("gemma3", "text model")])
def test_stored_moe_models_and_wrappers_are_refused(model_type, words, ct_dirs, hf_dirs, tmp_path):
    """A MoE model (its stored experts' load on the backend is not checked) and a multimodal
    wrapper (its text model would load without the quantization_config): config.json alone
    decides, the weights unread."""
    d = _unreadable(hf_dirs(model_type), tmp_path / model_type)
    q = json.loads((ct_dirs("fp8-tensor") / "config.json").read_text())["quantization_config"]
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", d, "--model-impl", "transformers", exit_code=2)
    assert_one_line_error(r, "pre-quantized" if model_type == "gemma3" else "native", words)
