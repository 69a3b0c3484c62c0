"""Bad settings and bad input refused with one line naming the fix, or kept to one row (issue
11): spec and flag types, float ids, invalid UTF-8, runaway templates, oversized allocations,
sbatch escaping, broken model directories, int4 group sizes."""

import json
import shutil
import subprocess

import pytest
import torch
import yaml
from helpers import (
    assert_one_line_error,
    decoder_config,
    prompt_file,
    prompts,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    success,
    write_parquet,
)

from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.job.fingerprint import options_fingerprint


def _model_copy(tmp_path, model, **config):
    """A copy of the tiny model whose config.json has `config` merged in (None: key removed)."""
    d = shutil.copytree(model, tmp_path / "model")
    hf = json.loads((d / "config.json").read_text())
    hf.update(config)
    hf = {k: v for k, v in hf.items() if v is not None}
    (d / "config.json").write_text(json.dumps(hf))
    return d


# --- 2. every spec value and flag is type- and range-checked ---


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"overwrite": "false"}, ["overwrite", "'false'", "bool"]),
        ({"max_new_tokens": 3.5}, ["max_new_tokens", "3.5", "expected int"]),
        ({"stop": 5}, ["stop", "5", "list of str"]),
        ({"temperature": "hot"}, ["temperature", "'hot'", "float"]),
        ({"kv_cache_tokens": "1e11"}, ["kv_cache_tokens", "'1e11'", "int"]),
        ({"model": 7}, ["model", "7", "str"]),
        ({"passthrough": ["prompt", 3]}, ["passthrough", "list of str"]),
        ({"compile": "no"}, ["compile", "'no'", "bool"]),
        ({"seed": -1}, ["seed must be in [0, 2147483647], got -1"]),
        ({"top_p": 0}, ["top_p must be in (0, 1], got 0"]),
        ({"flush_seconds": -1}, ["flush_seconds must be >= 0"]),
    ],
)
def test_spec_values_are_checked_against_the_option_types(tmp_path, model, values, words):
    src = prompt_file(tmp_path, 2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("")  # overwrite: "false" must not touch it
    spec = tmp_path / "job.yaml"
    base = {"input": str(src), "output": str(tmp_path / "out"), "model": str(model)}
    spec.write_text(yaml.safe_dump({**base, **values}))
    r = run_cli("run", spec, exit_code=2)
    assert_one_line_error(r, *words)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]


@pytest.mark.parametrize(
    "flags",
    [
        ("--seed", -1),
        ("--top-p", 0),
        ("--top-p", 1.5),
        ("--temperature", -0.5),
        ("--top-k", -1),
        ("--max-new-tokens", 0),
        ("--max-new-tokens", 3.5),
        ("--flush-seconds", -1),
        ("--kv-cache-tokens", "1e11"),
        ("--threads", 0),
    ],
)
def test_flag_values_are_usage_errors(tmp_path, model, flags):
    src = prompt_file(tmp_path, 2)
    r = run_cli("run", src, "-o", tmp_path / "out", "--model", model, *flags, exit_code=2)
    assert "Traceback" not in r.stderr
    assert f"Invalid value for '{flags[0]}'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_python_api_checks_types_too():
    with pytest.raises(ConfigError, match="overwrite: got 'false'"):
        RunConfig(input="in.parquet", output="out", overwrite="false")
    assert RunConfig(input="in.parquet", output="out", temperature=1).temperature == 1.0


# --- 3. float ids ---


@pytest.mark.parametrize("column", ["uid", "id"])  # named, or the default id column
def test_float_id_column_is_refused(tmp_path, model, column):
    src = write_parquet(
        tmp_path / "in.parquet",
        {"prompt": prompts(4), column: [1.0, float("nan"), float("nan"), 2.0]},
    )
    flag = ("--id-column", column) if column != "id" else ()
    r = run_job(src, tmp_path / "out", model, *flag, exit_code=2)
    assert_one_line_error(r, f"id column {column!r}", "cast it to int or string")
    assert not (tmp_path / "out").exists()


# --- 8. invalid UTF-8 on one line ---


def test_invalid_utf8_line_is_one_error_record(tmp_path, model):
    lines = [json.dumps({"prompt": p}).encode() for p in prompts(6)]
    lines[4] = b'{"prompt": "bad \xff\xfe bytes"}'
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2)
    rows = rows_by_id(out)
    assert sorted(rows) == list(range(6)) and success(out)
    assert "invalid UTF-8 in column 'prompt' of input row 4" in rows[4]["error"]
    assert rows[4]["prompt"] is None and rows[4]["finish_reason"] == "error"
    assert all(rows[i]["error"] is None for i in (0, 1, 2, 3, 5))


# --- 9. runaway templates ---


def test_runaway_template_is_a_row_error(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"text": ["short", "long"]})
    out = tmp_path / "out"
    template = (
        "{% if text == 'long' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "x{% endfor %}{% endfor %}{% endif %}Label: {{ text }}"
    )
    run_job(src, out, model, "-t", template, "--max-new-tokens", 2)
    rows = rows_by_id(out)
    assert rows[0]["error"] is None
    assert "simplify the template" in rows[1]["error"]
    huge = write_parquet(tmp_path / "huge.parquet", {"text": ["x"]})
    run_job(huge, tmp_path / "out2", model, "-t", "{{ text * 10**10 }}", "--max-new-tokens", 2)
    assert "simplify the template" in rows_by_id(tmp_path / "out2")[0]["error"]


# --- 10. allocations checked before they are made ---


def test_huge_rope_table_is_refused_naming_the_setting(tmp_path, model):
    big = _model_copy(tmp_path, model, max_position_embeddings=10**10)
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", big, exit_code=2)
    assert_one_line_error(
        r, "RoPE tables", "TiB", "lower max_position_embeddings in", "config.json"
    )


def test_huge_kv_cache_is_refused_naming_the_flag(tmp_path, model):
    src = prompt_file(tmp_path, 2)
    huge = ("--kv-cache-tokens", 10**11)
    r = run_job(src, tmp_path / "out", model, *huge, exit_code=2)
    assert_one_line_error(r, "KV cache of 100000000000 tokens", "TiB", "lower --kv-cache-tokens")
    r = run_cli("plan", src, "--model", model, *huge, exit_code=2)
    assert_one_line_error(r, "lower --kv-cache-tokens")


# --- 11. sbatch scripts ---


def test_slurm_quotes_paths_and_refuses_newlines(tmp_path, model):
    src = prompt_file(tmp_path, 2)
    out = tmp_path / "out dir"
    args = ("slurm", src, "--shards", 2, "--dry-run", "--", "-o", out, "--model", model)
    script = run_cli(*args[:5], "--job-name", "my job", *args[5:]).stdout
    assert f'#SBATCH --output="{out}/.batchgen/slurm/%A_%a.out"' in script
    assert '#SBATCH --job-name="my job"' in script
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    r = run_cli(*args[:5], "--job-name", "x\n#SBATCH --uid=0", *args[5:], exit_code=2)
    assert_one_line_error(r, "--job-name", "control character")
    r = run_cli(*args[:5], "--sbatch-arg", "--account=a\nrm -rf /", *args[5:], exit_code=2)
    assert_one_line_error(r, "--sbatch-arg", "control character")
    r = run_cli(*args[:5], "--partition", 'gpu"', *args[5:], exit_code=2)
    assert_one_line_error(r, "--partition", "quotes")


# --- 13. broken model directories ---


def _broken_config(tmp_path, model):
    d = shutil.copytree(model, tmp_path / "model")
    (d / "config.json").write_text('{"model_type": "llama", ')
    return d, ["config.json", "not readable JSON"]


def _incomplete_config(tmp_path, model):
    return _model_copy(tmp_path, model, hidden_size=None), ["config.json", "no 'hidden_size'"]


def _bad_size_config(tmp_path, model):
    return _model_copy(tmp_path, model, num_attention_heads=0), ["n_heads must be a positive"]


def _size_mismatch(tmp_path, model):
    d = _model_copy(tmp_path, model, intermediate_size=96)
    return d, ["does not match its config.json", "size mismatch", "same model"]


def _pickle_with_objects(tmp_path, model):
    import datetime

    d = shutil.copytree(model, tmp_path / "model")
    (d / "model.safetensors").unlink()
    torch.save({"when": datetime.date(2024, 1, 1)}, d / "pytorch_model.bin")
    return d, ["pytorch_model.bin", "more than tensors", "Weights only load failed"]


def _deeply_nested_config(tmp_path, model):
    d = shutil.copytree(model, tmp_path / "model")
    text = (d / "config.json").read_text().rstrip().removesuffix("}")
    (d / "config.json").write_text(text + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return d, ["config.json", "nested too deeply"]


def _no_tokenizer(tmp_path, model):
    d = shutil.copytree(model, tmp_path / "model")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    return d, ["has no tokenizer", "tokenizer.json", "save_pretrained"]


def _extra_layer(tmp_path, model):
    """A third layer's tensors in the weights of a 2-layer config.json."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(model, tmp_path / "model")
    weights = load_file(d / "model.safetensors")
    extra = {k.replace(".1.", ".2."): v.clone() for k, v in weights.items() if ".1." in k}
    save_file({**weights, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    return d, ["layers.2.", "2-layer model", "same model"]


def _encoder(tmp_path, model):
    """A BERT checkpoint's config.json (no weights: refused before any would load)."""
    import transformers

    d = shutil.copytree(model, tmp_path / "model")
    (d / "config.json").unlink()
    transformers.BertConfig(vocab_size=512, hidden_size=32, num_attention_heads=2).save_pretrained(
        d
    )
    return d, ["'bert' is not a causal LM", "decoder-only"]


@pytest.mark.parametrize(
    "make",
    [
        _broken_config,
        _incomplete_config,
        _bad_size_config,
        _size_mismatch,
        _pickle_with_objects,
        _deeply_nested_config,
        _no_tokenizer,
        _extra_layer,
        _encoder,
    ],
)
def test_broken_model_directory_is_a_one_line_error(tmp_path, model, make):
    d, words = make(tmp_path, model)
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", d, "--allow-pickle", exit_code=2)
    assert_one_line_error(r, *words)


OWN_CODE = {
    "tokenizer_config.json": {
        "tokenizer_class": "OwnTokenizer",
        "auto_map": {"AutoTokenizer": ["own.OwnTokenizer", None]},
    },
    "config.json": {
        "model_type": "own",
        "auto_map": {"AutoConfig": "own.OwnConfig", "AutoModelForCausalLM": "own.OwnModel"},
    },
}


@pytest.mark.parametrize("file", sorted(OWN_CODE))
def test_a_checkpoints_own_code_is_refused_never_run(tmp_path, model, file):
    """auto_map names a class of a .py file in the model directory: refused in one line (not
    transformers' interactive "run the custom code? [y/N]"), the file never run."""
    d = shutil.copytree(model, tmp_path / "model")
    values = json.loads((d / file).read_text())
    (d / file).write_text(json.dumps({**values, **OWN_CODE[file]}))
    (d / "own.py").write_text(f"open({str(d / 'ran')!r}, 'w').close()\n")
    r = run_job(prompt_file(tmp_path, 2), tmp_path / "out", d, exit_code=2)
    assert_one_line_error(r, file, "auto_map", "never runs")
    assert not (d / "ran").exists()


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_longrope_factor_list_of_the_wrong_length_is_a_one_line_error(tmp_path, impl):
    """Phi-3's short_factor needs head_dim / 2 values (8 here): 5 is refused by either
    implementation before anything else is read (transformers' own config class refuses it)."""
    rope = dict(rope_type="longrope", short_factor=[1.0] * 5, long_factor=[2.0] * 8)
    hf = decoder_config("phi3", 512, 64, 128, 2, 4, original_max_position_embeddings=64)
    d = tmp_path / "phi3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**hf, "rope_parameters": rope}))
    r = run_job(prompt_file(tmp_path, 2), tmp_path / "out", d, "--model-impl", impl, exit_code=2)
    assert_one_line_error(r, "config.json", "short_factor", "8")


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_an_extra_layer_is_a_one_line_error_on_either_implementation(tmp_path, model, impl):
    """Issue 38, item 22: transformers would load a 2-layer model and drop layer 2's tensors
    with a warning; the transformers backend refuses them as the native loader does."""
    d, words = _extra_layer(tmp_path, model)
    r = run_job(prompt_file(tmp_path, 2), tmp_path / "out", d, "--model-impl", impl, exit_code=2)
    assert_one_line_error(r, *words)


# --- 14. int4 group sizes ---


def test_int4_on_a_model_128_does_not_divide(tmp_path, model):
    """The tiny model is 32 wide (MLP 64): int4's default group of 128 divides no layer."""
    src = prompt_file(tmp_path, 3)
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 2, "--quantize", "int4")
    assert sorted(rows_by_id(out)) == [0, 1, 2]
    q = read_stats(out)["quantization"]
    assert q["group_size"] == 128 and q["granularity"] == "groups of 32/64"
    assert q["group_sizes"] == {
        "layers.*.attn.wqkv": 32,
        "layers.*.attn.wo": 32,
        "layers.*.mlp.w_in": 32,
        "layers.*.mlp.w_out": 64,
    }


def test_quant_group_size_is_checked():
    with pytest.raises(ConfigError, match="one of 32, 64, 128, 256"):
        RunConfig(input="x", output="y", quantize="int4", quant_group_size=48)
    with pytest.raises(ConfigError, match="int4 only"):
        RunConfig(input="x", output="y", quantize="int8", quant_group_size=64)
    cfg = RunConfig(input="x", output="y", quantize="int4", quant_group_size=64)
    assert options_fingerprint(cfg)["quant_group_size"] == 64
