"""LoRA on the transformers backend (model/hf/lora.py): the adapter applied by peft and merged
into the loaded model equals transformers + peft's merged model token for token (fused
projections, a multimodal wrapper's text model, a MoE model's attention, rsLoRA); its hash is
recorded as a native adapter's is; adapters it cannot merge (3-D expert weights, a module that
is not a linear layer) exit 2 with one line before any weight loads."""

import hashlib

import pytest
from helpers import (
    FAST,
    assert_one_line_error,
    hf_greedy,
    make_adapter,
    prompts,
    random_prompts,
    read_job,
    read_stats,
    run_cli,
    write_parquet,
)
from peft import LoraConfig

from batchgen.engine.sequence import SamplingParams
from batchgen.job.model_spec import ModelSpec
from batchgen.llm import LLM

MAX_NEW = 10
BACKEND = ("--model-impl", "transformers")  # Qwen3-MoE runs natively by default
PROMPTS = random_prompts([3, 9, 5, 14, 1, 7])
CASES = {
    # Phi-3's fused qkv_proj and gate_up_proj: whole matrices to peft
    "phi3-all": ("phi3", dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])),
    # the adapter of the wrapper (its vision tower's q/v too), merged into the text model
    "gemma3-wrapper": ("gemma3", dict(target_modules=["q_proj", "v_proj", "down_proj"])),
    "qwen3_moe-attn": (
        "qwen3_moe",
        dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    ),
}


def _generate(model_dir, **kw) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", device="cpu", model_impl="transformers", **kw)
    return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))]


@pytest.mark.parametrize("case", CASES)
def test_merged_adapter_equals_peft_merge_and_unload(case, hf_dirs, tmp_path):
    model_type, kw = CASES[case]
    peft_model = make_adapter(hf_dirs(model_type), tmp_path / "adapter", LoraConfig(r=4, **kw))
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    want = hf_greedy(tmp_path / "merged", PROMPTS, MAX_NEW)

    got = _generate(hf_dirs(model_type), lora=tmp_path / "adapter")
    assert got == want
    assert got != _generate(hf_dirs(model_type))  # the adapter changed the tokens
    adapter = tmp_path / "adapter"
    spec = ModelSpec.resolve(
        hf_dirs(model_type), device="cpu", lora=adapter, model_impl="transformers"
    )
    text_layers = [m for m in spec.lora.merges if "vision" not in m.module]
    assert len(spec.lora.merges) == len(text_layers) == 2 * len(kw["target_modules"])


def test_cli_records_the_adapter_hash(hf_dirs, tmp_path):
    d = hf_dirs("phi3")
    make_adapter(d, tmp_path / "adapter", LoraConfig(r=4, target_modules=["qkv_proj"]))
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    args = ("--model", d, *FAST, "--lora", tmp_path / "adapter", *BACKEND)  # phi3: native too
    run_cli("run", src, "-o", tmp_path / "out", *args)
    sha = hashlib.sha256((tmp_path / "adapter" / "adapter_model.safetensors").read_bytes())
    stats = read_stats(tmp_path / "out")
    assert stats["model_impl"] == "transformers"
    assert (
        stats["lora"]["sha256"] == read_job(tmp_path / "out")["lora"]["sha256"] == sha.hexdigest()
    )
    assert stats["lora"]["targets"] == ["qkv_proj"]


@pytest.mark.parametrize(
    "model_type, config, words",
    [
        # MoE experts held as one 3-D tensor: peft's target_parameters
        (
            "qwen3_moe",
            dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]),
            ("target_parameters", "3-D", "cannot merge"),
        ),
        # an embedding's LoRA: peft saves the embedding whole beside it
        ("phi3", dict(target_modules=["embed_tokens"]), ("embed_tokens", "LoRA linear layer")),
    ],
)
def test_adapters_it_cannot_merge_exit_2(model_type, config, words, hf_dirs, tmp_path):
    make_adapter(hf_dirs(model_type), tmp_path / "adapter", LoraConfig(r=4, **config))
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    args = ("--model", hf_dirs(model_type), *FAST, "--lora", tmp_path / "adapter", *BACKEND)
    r = run_cli("run", src, "-o", tmp_path / "out", *args, exit_code=2)
    assert_one_line_error(r, "LoRA adapter", *words)


def test_adapter_of_another_base_model_is_refused(hf_dirs, tmp_path):
    """Phi-3's fused qkv_proj: Gemma 3 has none."""
    make_adapter(
        hf_dirs("phi3"), tmp_path / "adapter", LoraConfig(r=4, target_modules=["qkv_proj"])
    )
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    args = ("--model", hf_dirs("gemma3"), *FAST, "--lora", tmp_path / "adapter", *BACKEND)
    r = run_cli("run", src, "-o", tmp_path / "out", *args, exit_code=2)
    assert_one_line_error(r, "LoRA adapter", "qkv_proj", "no such module", "another base model")
