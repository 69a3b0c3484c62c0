"""Paths a new user passes (issue 31 B, C): object-store URLs and file-named outputs are
refused with the form that works; `builtin:` paths work in the Python API as on the line."""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error, run_cli, success, write_parquet

from batchgen import RunConfig
from batchgen.errors import ConfigError
from batchgen.job.paths import ASSETS


@pytest.fixture
def source(tmp_path):
    return write_parquet(tmp_path / "in.parquet", {"prompt": ["the quick fox"]})


@pytest.mark.parametrize("output", ["s3://bucket/out", "gs://b/o", "hf://datasets/me/out"])
def test_object_store_output_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, model, source, output
):
    monkeypatch.chdir(tmp_path)
    r = run_cli("run", source, "-o", output, "--model", model, exit_code=2)
    assert_one_line_error(r, output, "not supported yet", "local directory", "copy")
    assert "wrote" not in r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]  # no ./s3:/bucket/out


def test_object_store_input_is_refused(tmp_path, model):
    r = run_cli(
        "run", "s3://bucket/in.parquet", "-o", tmp_path / "out", "--model", model, exit_code=2
    )
    assert_one_line_error(r, "input s3://bucket/in.parquet", "not supported yet")


@pytest.mark.parametrize("name", ["results.jsonl", "out.json", "out.parquet", "OUT.CSV"])
def test_file_named_output_is_refused_naming_the_directory_form(tmp_path, model, source, name):
    r = run_cli("run", source, "-o", tmp_path / name, "--model", model, exit_code=2)
    assert_one_line_error(r, "names a file", "-o OUT", "--output-format openai")
    assert not (tmp_path / name).exists()


def test_refused_in_the_python_api_too(tmp_path):
    with pytest.raises(ConfigError, match="not supported yet"):
        RunConfig(input="in.parquet", output="s3://bucket/out")
    with pytest.raises(ConfigError, match="--output-format openai"):
        RunConfig(input="in.parquet", output=str(tmp_path / "results.jsonl"))


def test_builtin_paths_resolve_in_run_config(tmp_path):
    cfg = RunConfig(input="builtin:samples/reviews.parquet", output=str(tmp_path / "out"))
    assert cfg.input == str(ASSETS / "samples" / "reviews.parquet")
    from batchgen.data import open_input

    assert open_input(cfg.input).num_rows > 0


def test_builtin_input_runs_through_the_python_api(tmp_path, model):
    from batchgen import run

    out = tmp_path / "out"
    cfg = RunConfig(
        input="builtin:samples/prompts.parquet",
        output=str(out),
        model=str(model),
        limit=2,
        max_new_tokens=2,
        device="cpu",
        compile=False,
        kv_cache_tokens=4096,
        quiet=True,
    )
    run(cfg)
    assert success(out)
