"""--quantize int8 on the transformers backend (quant/hf_quantize.py): the decoder layers'
linears quantized by the scheme's backend, a layer at a time; the tokens equal native int8's on
the same Llama checkpoint (per-channel int8 of a fused q/k/v matrix is that of each part).
Refused before loading: int4, and a model whose MoE experts are 3-D weights."""

import pytest
from helpers import (
    FAST,
    assert_one_line_error,
    prompts,
    random_prompts,
    read_stats,
    run_cli,
    write_parquet,
)

from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM

PROMPTS = random_prompts([3, 9, 5, 14, 1, 7])


@pytest.mark.parametrize("backend", ["torchao", "quanto"])
def test_int8_equals_native_int8(backend, hf_dirs):
    runs = {}
    for impl in ("native", "transformers"):
        llm = LLM(
            hf_dirs("llama"),
            dtype="float32",
            device="cpu",
            model_impl=impl,
            quantize="int8",
            quant_backend=backend,
        )
        runs[impl] = llm
    tokens = {
        impl: [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=10))]
        for impl, llm in runs.items()
    }
    assert tokens["transformers"] == tokens["native"]
    hf = runs["transformers"]
    assert hf.weights_bytes_per_rank == runs["native"].weights_bytes_per_rank
    float_bytes = LLM(
        hf_dirs("llama"), device="cpu", model_impl="transformers"
    ).weights_bytes_per_rank
    assert hf.weights_bytes_per_rank < 0.7 * float_bytes
    q = hf.quant.to_dict()
    assert q["method"] == "int8" and "layers.*.self_attn.q_proj" in q["modules"]
    assert "layers.*.attn.wqkv" not in q["modules"]


def test_cli_records_the_backend_scheme(hf_dirs, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    args = ("--model", hf_dirs("phi3"), *FAST, "--model-impl", "transformers")  # phi3: native too
    run_cli("run", src, "-o", out, *args, "--quantize", "int8")
    stats = read_stats(out)
    assert stats["model_impl"] == "transformers"
    assert "layers.*.self_attn.qkv_proj" in stats["quantization"]["modules"]


@pytest.mark.parametrize(
    "model_type, quantize, words",
    [
        ("qwen3_moe", "int8", ("3-D weights", "mlp.experts", "cannot quantize")),
        ("phi3", "int4", ("--quantize int4", "int8 or fp8")),
    ],
)
def test_refused_before_loading(model_type, quantize, words, hf_dirs, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    args = ("--model", hf_dirs(model_type), *FAST, "--model-impl", "transformers")
    r = run_cli("run", src, "-o", tmp_path / "o", *args, "--quantize", quantize, exit_code=2)
    assert_one_line_error(r, *words)
