"""One resolution of a job: `batchgen run` and the Python API `LLM()` build their engine from
one ModelSpec, with the same defaults, and a job resolves its model once: one tokenizer, one
read of config.json, one grammar compiler for the job's constraint and the engine's rows."""

from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    assert_one_line_error,
    prompts,
    rows_by_id,
    run_cli,
    run_job,
    write_parquet,
)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchgen.engine.config import EngineConfig
from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.job.model_spec import ModelSpec
from batchgen.job.open import open_job
from batchgen.llm import LLM

SAME = ("model_dir", "model_cfg", "eos_ids", "device", "dtype", "compile", "quant", "lora")


def _job(tmp_path: Path, model: Path, **kw) -> RunConfig:
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    return RunConfig(input=str(src), output=str(tmp_path / "out"), model=str(model), **kw)


def test_run_and_the_api_resolve_the_same_spec(tmp_path, model):
    job = open_job(_job(tmp_path, model, device="cpu"))
    llm = LLM(model, device="cpu")
    assert job.spec.engine == llm.config == llm.engine.config == EngineConfig.for_device("cpu")
    for name in SAME:
        assert getattr(job.spec, name) == getattr(llm.spec, name), name
    # the flags of the engine reach it through the same resolution
    job = open_job(
        _job(
            tmp_path,
            model,
            device="cpu",
            max_num_seqs=3,
            block_size=8,
            prefix_caching=False,
            window_rows=5,
        )
    )
    want = EngineConfig(max_num_seqs=3, block_size=8, prefix_caching=False, read_ahead=5)
    assert job.spec.engine == want
    assert ModelSpec.resolve(model, device="cpu", engine=want).engine is want
    # a compiled CPU decode gets 64 sequences (engine/config.py for_device), by both doors
    job = open_job(_job(tmp_path, model, device="cpu", compile=True))
    assert job.spec.compile and job.spec.engine.max_num_seqs == 64
    assert ModelSpec.resolve(model, device="cpu", compile=True).engine.max_num_seqs == 64


def test_on_a_gpu_run_and_the_api_get_the_gpu_defaults(tmp_path, model, monkeypatch):
    """Resolution touches no device memory, so a machine that claims a GPU shows which
    defaults each front door would build the engine with."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    job = open_job(_job(tmp_path, model))
    specs = []  # what LLM() would load, instead of loading it onto the absent GPU
    monkeypatch.setattr(LLM, "_load", lambda self, spec, resumable: specs.append(spec))
    LLM(model)
    (api,) = specs
    assert job.spec.device.type == api.device.type == "cuda"
    assert job.spec.engine == api.engine == EngineConfig.for_device("cuda")
    assert (job.spec.engine.max_num_seqs, job.spec.engine.max_num_batched_tokens) == (256, 8192)
    for name in SAME:
        assert getattr(job.spec, name) == getattr(api, name), name
    assert (api.dtype, api.compile) == (torch.bfloat16, True)


def test_a_job_loads_its_tokenizer_and_reads_config_json_once(tmp_path, model, monkeypatch):
    import xgrammar as xgr

    calls: Counter = Counter()

    def counted(key, fn):
        def wrapper(*args, **kw):
            calls[key] += 1
            return fn(*args, **kw)

        return wrapper

    for cls in (AutoTokenizer, PreTrainedTokenizerFast):  # load_tokenizer takes either
        monkeypatch.setattr(cls, "from_pretrained", counted("tokenizer", cls.from_pretrained))
    monkeypatch.setattr(
        xgr.TokenizerInfo,
        "from_huggingface",
        counted("grammar vocabulary", xgr.TokenizerInfo.from_huggingface),
    )
    read_text = Path.read_text

    def reading(path, *args, **kw):
        calls[path.name] += 1
        return read_text(path, *args, **kw)

    monkeypatch.setattr(Path, "read_text", reading)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    out = tmp_path / "out"
    # the job's constraint is compiled in open_job, before loading; its rows in the engine
    run_job(src, out, model, "--max-new-tokens", 3, "--choice", "yes,no")
    assert calls["tokenizer"] == 1
    assert calls["config.json"] == calls["generation_config.json"] == 1
    assert calls["grammar vocabulary"] == 1
    rows = rows_by_id(out)
    assert sorted(rows) == [0, 1, 2, 3] and {r["generated_text"] for r in rows.values()} <= {
        "yes",
        "no",
    }


def test_a_device_that_is_not_there_is_a_config_error_for_both(tmp_path, model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        open_job(_job(tmp_path, model, device="cuda"))
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        LLM(model, device="cuda")


def test_a_scheme_that_cannot_run_is_refused_before_the_output_is_claimed(tmp_path, model):
    """The scheme is resolved with the rest of the spec, so `run` and `plan` refuse it before
    anything is written (it was checked only at load, after the output was claimed)."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    spec = tmp_path / "job.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "input": str(src),
                "output": str(tmp_path / "out"),
                "model": str(model),
                "device": "cpu",
                "quantize": "int4",
                "quant_backend": "quanto",
                "dtype": "bfloat16",
            }
        )
    )
    for command in ("run", "plan"):
        r = run_cli(command, spec, exit_code=2)
        assert_one_line_error(r, "int4 with backend quanto is not available on cpu with bfloat16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_the_tokenizer_is_the_one_autotokenizer_gives(tiny_dirs, family):
    """load_tokenizer skips AutoTokenizer's tables where it would give the generic class:
    the class and the tokens must be AutoTokenizer's (a transformers upgrade that gives a
    model type its own class fails here)."""
    import json

    from batchgen.job.tokenizer import load_tokenizer

    d = tiny_dirs[family]
    model_type = json.loads((d / "config.json").read_text())["model_type"]
    ours, auto = load_tokenizer(d, model_type), AutoTokenizer.from_pretrained(d)
    assert type(ours) is type(auto)
    for text in ("Hello world", "Review: great!\nSentiment:", " positive", "ünïcödé 日本"):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == auto.decode(ids)
    assert (ours.eos_token_id, ours.chat_template) == (auto.eos_token_id, auto.chat_template)


def test_a_tokenizers_own_length_limit_prints_nothing(model, tmp_path):
    """A tokenizer_config.json model_max_length below the prompts' lengths: batchgen bounds the
    prompts itself, and transformers' "Token indices sequence length is longer ..." warning no
    longer reaches the job's output (a process's stderr: transformers' handler is its own)."""
    import json
    import shutil
    import subprocess

    from helpers import cli_command

    d = shutil.copytree(model, tmp_path / "model")
    tok = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok, "model_max_length": 4}))
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    cmd = cli_command("run", src, "-o", tmp_path / "out", "--model", d, "--max-new-tokens", 2)
    r = subprocess.run([*cmd, "--device", "cpu", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Token indices" not in r.stderr and "wrote" in r.stdout
