"""LoRA adapters: a random PEFT adapter (non-zero B) merged by batchgen gives exactly the greedy
output of transformers' merge_and_unload() model, float32, token for token; adapters that do not
fit the model, or use what a plain merge cannot express, are refused with the mismatch named."""

import hashlib
import json

import pyarrow.parquet as pq
import pytest
import torch
import transformers
from helpers import cpu_llm, make_adapter, prompt_file, prompts, read_stats, rows_by_id, run_job
from peft import IA3Config, LoraConfig
from test_exactness import MAX_NEW, _prompts, hf_greedy
from tiny_models import save_tiny_model

from batchgen.data.layout import JOB_FILE
from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.checkpoint.lora import LoraError, check_adapter, merge_lora
from batchgen.model.families.hf_config import config_from_hf, read_hf_config

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_ALL = ["c_attn", "c_proj", "c_fc"]


def _llm(model_dir, **kw) -> LLM:
    return cpu_llm(model_dir, engine=EngineConfig(max_num_seqs=4), **kw)


CASES = {
    "llama-all": ("llama", dict(target_modules=LLAMA_ALL)),
    "gpt2-all": ("gpt2", dict(target_modules=GPT2_ALL, fan_in_fan_out=True)),
    # head_dim 16 != hidden / heads, and GQA: the q, k and v slices of wqkv all differ
    "qwen3-attn": ("qwen3", dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "qwen2-k-up": ("qwen2", dict(target_modules=["k_proj", "up_proj"])),
    "llama-rslora": ("llama", dict(target_modules=["v_proj", "gate_proj"], use_rslora=True)),
    "llama-patterns": (
        "llama",
        dict(
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"v_proj": 2},
            alpha_pattern={"down_proj": 3},
        ),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_merged_adapter_matches_transformers_merge_and_unload(case, tiny_dirs, tmp_path):
    family, kw = CASES[case]
    base = tiny_dirs[family]
    peft_model = make_adapter(base, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, **kw))
    adapted = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    want = hf_greedy(tmp_path / "merged", _prompts(), MAX_NEW)

    llm = _llm(base, lora=tmp_path / "adapter")
    got = [c.token_ids for c in llm.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))]
    assert got == want
    plain = _llm(base).generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW))
    assert got != [c.token_ids for c in plain]  # the adapter really changed the model
    assert llm.lora.targets == tuple(sorted(kw["target_modules"]))
    assert len(llm.lora.merges) == len(adapted)


def test_merged_weights_equal_peft_merged_checkpoint_and_are_quantized(tiny_dirs, tmp_path):
    base = tiny_dirs["llama"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    make_adapter(base, tmp_path / "adapter", config).merge_and_unload().save_pretrained(
        tmp_path / "merged"
    )
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "merged")
    ours = load_model(base)
    merge_lora(ours, tmp_path / "adapter")
    theirs = load_model(tmp_path / "merged").state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), name  # bit for bit, fused slices included
    # quantization sees the merged weights: the same as quantizing peft's merged checkpoint
    params = SamplingParams(max_new_tokens=MAX_NEW)
    got = _llm(base, lora=tmp_path / "adapter", quantize="int8").generate(_prompts(), params)
    want = _llm(tmp_path / "merged", quantize="int8").generate(_prompts(), params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


@pytest.fixture(scope="module")
def llama_adapter(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora") / "adapter"
    make_adapter(tiny_dirs["llama"], d, LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_ALL))
    return d


def test_cli_records_the_adapter_and_refuses_one_changed_in_place(
    tmp_path, tiny_dirs, llama_adapter
):
    model, mine = tiny_dirs["llama"], tmp_path / "adapter"
    mine.mkdir()
    for f in llama_adapter.iterdir():
        (mine / f.name).write_bytes(f.read_bytes())
    args = (prompt_file(tmp_path, 6), tmp_path / "out", model, "--max-new-tokens", 6)
    run_job(*args, "--lora", mine)

    sha = hashlib.sha256((mine / "adapter_model.safetensors").read_bytes()).hexdigest()
    lora = read_stats(tmp_path / "out")["lora"]
    assert lora["path"] == str(mine.resolve()) and lora["sha256"] == sha
    assert (lora["r"], lora["alpha"], lora["targets"]) == (4, 8, sorted(LLAMA_ALL))
    job = json.loads((tmp_path / "out" / JOB_FILE).read_text())
    assert job["lora"] == {"path": str(mine.resolve()), "sha256": sha}
    part = sorted((tmp_path / "out").glob("part-*.parquet"))[0]
    assert json.loads(pq.read_schema(part).metadata[b"batchgen"])["lora"]["sha256"] == sha
    rows = rows_by_id(tmp_path / "out")
    texts = [rows[i]["generated_text"] for i in range(6)]
    llm = cpu_llm(model, lora=mine)
    assert texts == [c.text for c in llm.generate(prompts(6), SamplingParams(max_new_tokens=6))]

    run_job(*args, "--lora", mine)  # the same job again: complete, nothing to do
    assert "another job" in run_job(*args, exit_code=2).stderr  # without the adapter
    # retrained in place: the same path, another hash, so another job
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    make_adapter(model, tmp_path / "retrained", config, seed=1)
    (mine / "adapter_model.safetensors").write_bytes(
        (tmp_path / "retrained" / "adapter_model.safetensors").read_bytes()
    )
    assert "another job" in run_job(*args, "--lora", mine, exit_code=2).stderr


def test_adapter_for_another_hidden_size_is_a_usage_error(tmp_path, tiny_dirs):
    wide = save_tiny_model("llama", tmp_path / "wide", hidden_size=64, intermediate_size=128)
    make_adapter(wide, tmp_path / "adapter", LoraConfig(r=4, target_modules=["q_proj"]))
    src = prompt_file(tmp_path, 2)
    result = run_job(
        src, tmp_path / "out", tiny_dirs["llama"], "--lora", tmp_path / "adapter", exit_code=2
    )
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert str(tmp_path / "adapter") in err and "does not fit" in err
    assert "64" in err and "32" in err
    assert not (tmp_path / "out").exists()  # refused before the output was claimed


def _refusal(base_dir, adapter_dir) -> str:
    with pytest.raises(LoraError) as e:
        check_adapter(adapter_dir, config_from_hf(read_hf_config(base_dir)))
    msg = str(e.value)
    assert str(adapter_dir) in msg and "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "config, expect",
    [
        (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
        (LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), "lm_head, which batchgen cannot"),
        (LoraConfig(r=4, target_modules=["embed_tokens"]), "not the A or B matrix"),
        (LoraConfig(r=4, target_modules=["q_proj"], bias="lora_only"), "trained biases"),
        (
            LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
            "modules_to_save",
        ),
        (
            IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
            "IA3 adapter",
        ),
    ],
    ids=["dora", "lm_head", "embedding", "bias", "modules_to_save", "ia3"],
)
def test_unsupported_adapters_are_refused(config, expect, tmp_path, tiny_dirs):
    make_adapter(tiny_dirs["llama"], tmp_path / "adapter", config)
    assert expect in _refusal(tiny_dirs["llama"], tmp_path / "adapter")


def test_adapter_for_more_layers_or_missing_files_is_refused(tmp_path, tiny_dirs):
    deep = save_tiny_model("llama", tmp_path / "deep", num_hidden_layers=3)
    make_adapter(deep, tmp_path / "adapter", LoraConfig(r=4, target_modules=["o_proj"]))
    assert "the model has 2 layers" in _refusal(tiny_dirs["llama"], tmp_path / "adapter")
    assert "does not exist" in _refusal(tiny_dirs["llama"], tmp_path / "nowhere")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in _refusal(tiny_dirs["llama"], tmp_path / "adapter")
