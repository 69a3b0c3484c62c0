"""Issue 31: the model's generation_config.json sets the job's defaults (max_new_tokens,
temperature, top_p, top_k; do_sample false is greedy), as vLLM's generation_config="auto" and
transformers do; flags and job spec values override them, and stats.json says where each came
from. The Python API's generate uses them when given no SamplingParams."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import FAST, prompts, read_output, read_stats, run_cli, run_job, write_parquet

from batchgen.job.generation import MODEL, GenerationDefaults, read_generation_config


@pytest.fixture(scope="module")
def model5(model, tmp_path_factory) -> Path:
    """The tiny Llama, shipped for 5 new tokens, sampling off whatever temperature it lists."""
    d = tmp_path_factory.mktemp("gen") / "llama5"
    shutil.copytree(model, d)
    path = d / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(
        json.dumps(
            {**gen, "max_new_tokens": 5, "do_sample": False, "top_p": 0.9, "temperature": 0.7}
        )
    )
    return d


def _counts(out: Path) -> set[int]:
    return set(read_output(out).column("completion_tokens").to_pylist())


def test_model_defaults_apply(tmp_path, model5):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    run_job(src, tmp_path / "out", model5, "--ignore-eos")
    assert _counts(tmp_path / "out") == {5}
    gen = read_stats(tmp_path / "out")["generation_defaults"]
    assert gen["max_new_tokens"] == {"value": 5, "from": MODEL}
    assert gen["temperature"] == {"value": 0.0, "from": MODEL}  # do_sample false: greedy
    assert gen["top_p"] == {"value": 0.9, "from": MODEL}
    assert gen["top_k"] == {"value": 0, "from": "batchgen"}


def test_flags_and_job_spec_override(tmp_path, model5):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    run_job(src, tmp_path / "flag", model5, "--ignore-eos", "--max-new-tokens", 3)
    assert _counts(tmp_path / "flag") == {3}
    gen = read_stats(tmp_path / "flag")["generation_defaults"]
    assert gen["max_new_tokens"] == {"value": 3, "from": "option"}
    spec = tmp_path / "job.yaml"
    spec.write_text(f"input: {src}\nmax_new_tokens: 2\ntemperature: 0.5\nignore_eos: true\n")
    run_cli("run", spec, "-o", tmp_path / "spec", "--model", model5, *FAST)
    assert _counts(tmp_path / "spec") == {2}
    gen = read_stats(tmp_path / "spec")["generation_defaults"]
    assert gen["max_new_tokens"]["from"] == gen["temperature"]["from"] == "option"
    assert gen["temperature"]["value"] == 0.5


def test_batchgen_defaults_without_generation_config_values(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 4)
    gen = read_stats(tmp_path / "out")["generation_defaults"]
    assert gen["temperature"] == {"value": 0.0, "from": "batchgen"}
    assert gen["max_new_tokens"] == {"value": 4, "from": "option"}


def test_plan_shows_the_defaults(tmp_path, model5):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_cli("plan", src, "--model", model5, "--device", "cpu", "--json")
    assert json.loads(r.stdout)["generation_defaults"]["max_new_tokens"]["value"] == 5
    r = run_cli("plan", src, "--model", model5, "--device", "cpu")
    assert "max_new_tokens 5 (generation_config.json)" in r.stdout


def test_bad_model_values_are_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": -1, "top_p": 0, "top_k": -1, "max_new_tokens": 0})
    )
    d = GenerationDefaults.resolve({}, read_generation_config(tmp_path))
    assert d.values == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    assert d.sources["top_k"] == MODEL  # -1 is transformers' and vLLM's "off"


def test_api_uses_the_model_defaults(model5):
    from batchgen import LLM, SamplingParams

    with LLM(model5, device="cpu", compile=False) as llm:
        sp = llm.get_default_sampling_params()
        assert (sp.max_tokens, sp.temperature, sp.top_p) == (5, 0.0, 0.9)
        [out] = llm.generate("the quick brown fox")
        assert len(out.outputs[0].token_ids) <= 5
        [out] = llm.generate(
            "the quick brown fox", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        )
        assert len(out.outputs[0].token_ids) == 7
