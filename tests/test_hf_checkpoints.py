"""Checkpoints that are more than a float causal LM: multimodal wrappers run as their text model
(Gemma 3 on the transformers backend, Mistral 3 natively: its text model is a Mistral), gpt-oss's
MXFP4 experts dequantized at load, and MoE models whose every expert `plan` counts. Each run is
the CLI's on a Parquet file, its tokens equal to transformers' own generation on the same
checkpoint (sharpened tiny models: a wrong weight or a missing feature changes them)."""

import json
import shutil

import pytest
import torch
import transformers
from helpers import (
    FAST,
    assert_one_line_error,
    hf_greedy,
    prompts,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    write_parquet,
)
from safetensors.torch import load_file, save_file
from tiny_hf_models import quantize_experts_mxfp4, save_tiny_hf_model

from batchgen.engine.sequence import SamplingParams
from batchgen.job.tokenization import tokenize
from batchgen.llm import LLM
from batchgen.model.checkpoint.multimodal import TEXT_MODEL_WRAPPERS

MAX_NEW = 10
ROWS = 6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> a tiny checkpoint, written at first use: a model type of tiny_hf_models, or
    "gpt_oss_mxfp4" (gpt-oss with its experts as MXFP4)."""
    made = {}

    def get(name):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            made[name] = save_tiny_hf_model(name.removesuffix("_mxfp4"), d)
            if name.endswith("_mxfp4"):
                quantize_experts_mxfp4(d)
        return made[name]

    return get


def _cli_tokens(model_dir, tmp_path, *flags) -> tuple[list[list[int]], dict]:
    """The generated token ids of a CLI run over prompts(ROWS), and its stats."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(ROWS)})
    out = tmp_path / "out"
    run_job(src, out, model_dir, "--max-new-tokens", MAX_NEW, "--with-token-ids", *flags)
    rows = rows_by_id(out)
    return [rows[i]["token_ids"] for i in range(ROWS)], read_stats(out)


def _prompt_ids(model_dir) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tokenize(tok, prompts(ROWS))


def _assert_live(want: list[list[int]]) -> None:
    """A reference whose rows are not one repeated token: equality with it means something."""
    assert sum(len(set(row)) > 2 for row in want) > len(want) // 2, want


@pytest.mark.parametrize("model_type, impl", [("gemma3", "native"), ("mistral3", "native")])
def test_multimodal_text_job_equals_transformers(model_type, impl, dirs, tmp_path, monkeypatch):
    d = dirs(model_type)
    got, stats = _cli_tokens(d, tmp_path)
    assert stats["model_impl"] == impl and stats["family"] == model_type
    # transformers' own: the whole wrapper (Mistral 3 has no AutoModelForCausalLM class)
    monkeypatch.setattr(
        transformers, "AutoModelForCausalLM", transformers.AutoModelForImageTextToText
    )
    want = hf_greedy(d, _prompt_ids(d), MAX_NEW)
    assert got == want
    _assert_live(want)


@pytest.mark.parametrize("model_type", sorted(TEXT_MODEL_WRAPPERS))
def test_multimodal_loads_no_vision_tower_and_plan_says_so(model_type, dirs, tmp_path):
    d = dirs(model_type)
    llm = LLM(d, dtype="float32", device="cpu")
    names = [n for n, _ in llm.model.named_parameters()]
    assert names and not [n for n in names if "vision" in n or "projector" in n]
    wrapper = transformers.AutoModelForImageTextToText.from_pretrained(d)
    text = sum(p.numel() for n, p in wrapper.named_parameters() if "language_model" in n)
    head = wrapper.lm_head.weight
    text += 0 if head is wrapper.get_input_embeddings().weight else head.numel()
    assert sum(p.numel() for p in llm.model.parameters()) == text
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    plan = json.loads(run_cli("plan", src, "--model", d, "--json").stdout)
    # the text model's bytes, not the vision tower's (native counts leave the norms out)
    assert 0.99 * text * 4 <= plan["weights_bytes_per_rank"] <= text * 4
    (note,) = plan["load_notes"]
    assert "vision_tower" in note and "multi_modal_projector" in note and "not loaded" in note
    assert "note: text model only" in run_cli("plan", src, "--model", d).stdout


def test_mistral3_on_the_backend_equals_native(dirs):
    """--model-impl transformers loads the text model (MistralForCausalLM) from the wrapper."""
    d = dirs("mistral3")
    prompts_ = _prompt_ids(d)
    native = LLM(d, dtype="float32", device="cpu")
    backend = LLM(d, dtype="float32", device="cpu", model_impl="transformers")
    assert type(backend.model.hf).__name__ == "MistralForCausalLM"
    params = SamplingParams(max_new_tokens=MAX_NEW)
    got = [c.token_ids for c in backend.generate(prompts_, params)]
    assert got == [c.token_ids for c in native.generate(prompts_, params)]


def _transformers5_name(name: str) -> str:
    """A wrapper's tensor name as transformers 4 saved it -> as transformers 5 holds it."""
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name  # vision_tower.*, multi_modal_projector.*


def test_the_transformers_5_layout_of_a_wrapper_loads_too(dirs, tmp_path):
    """Either layout of a wrapper's names runs, natively and on the backend, to the same
    tokens."""
    d = tmp_path / "v5"
    shutil.copytree(dirs("mistral3"), d)
    tensors = load_file(d / "model.safetensors")
    renamed = {_transformers5_name(k): t for k, t in tensors.items()}
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in renamed
    save_file(renamed, d / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(max_new_tokens=MAX_NEW)
    ids = _prompt_ids(d)
    want = [c.token_ids for c in LLM(dirs("mistral3"), device="cpu").generate(ids, params)]
    for impl in ("native", "transformers"):
        llm = LLM(d, dtype="float32", device="cpu", model_impl=impl)
        assert [c.token_ids for c in llm.generate(ids, params)] == want, impl


def test_mxfp4_is_dequantized_at_load_equal_to_transformers(dirs, tmp_path):
    d = dirs("gpt_oss_mxfp4")
    got, stats = _cli_tokens(d, tmp_path)
    assert stats["model_impl"] == "transformers"
    # transformers' own dequantization, saved as a float checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    hf.save_pretrained(tmp_path / "float")
    want = hf_greedy(tmp_path / "float", _prompt_ids(d), MAX_NEW)
    assert got == want
    _assert_live(want)
    # the float checkpoint's experts are not the MXFP4 ones: a plain load would differ
    assert hf_greedy(dirs("gpt_oss"), _prompt_ids(d), MAX_NEW) != want


def test_mxfp4_plan_names_the_dequantized_cost(dirs, tmp_path):
    d = dirs("gpt_oss_mxfp4")
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    plans = {
        dtype: json.loads(run_cli("plan", src, "--model", d, "--dtype", dtype, "--json").stdout)
        for dtype in ("float32", "bfloat16")
    }
    with torch.device("meta"):
        float_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(d)
        )
    n = sum(p.numel() for p in float_model.parameters())
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        assert plans[dtype]["weights_bytes_per_rank"] == n * size
        (note,) = plans[dtype]["load_notes"]
        assert "MXFP4" in note and "dequantized" in note and dtype in note
    assert "note: MXFP4 experts dequantized" in run_cli("plan", src, "--model", d).stdout


def test_other_pre_quantized_checkpoints_are_refused_naming_the_method(dirs, tmp_path):
    d = tmp_path / "gptq"
    config = json.loads((dirs("llama") / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    args = ("--model", d, *FAST, "--model-impl", "transformers")
    r = run_cli("run", src, "-o", tmp_path / "out", *args, exit_code=2)
    assert_one_line_error(r, "pre-quantized (gptq)", "mxfp4")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_plan_counts_every_expert(model_type, dirs, tmp_path):
    """The memory figure holds all experts' weights (the loaded model's bytes), not the ones a
    token routes to."""
    d = dirs(model_type)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    flags = ("--json", "--model-impl", "transformers")
    plan = json.loads(run_cli("plan", src, "--model", d, *flags).stdout)
    llm = LLM(d, dtype="float32", device="cpu", model_impl="transformers")
    experts = sum(p.numel() for n, p in llm.model.named_parameters() if ".experts." in n)
    every = sum(p.numel() for p in llm.model.parameters())
    assert experts >= 4 * 2 * 3 * 64 * 32  # 4 experts a layer, 2 layers, 3 matrices
    assert plan["weights_bytes_per_rank"] == llm.weights_bytes_per_rank == every * 4
