"""Issue 31: the longest prompt defaults to what the model's positions leave after the new
tokens (it was 1024 whatever the model allowed), and --max-model-len (vLLM's name) bounds
prompt + output: rows over it are error rows naming the flag, or cut per --truncate; `plan`
shows the limits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    assert_one_line_error,
    read_output,
    rows_by_id,
    run_cli,
    run_job,
    write_parquet,
)

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # well over 32 tokens


@pytest.fixture(scope="module")
def long_model(model, tmp_path_factory) -> Path:
    """The tiny Llama with 2048 positions (RoPE has no weights, so they load as they are)."""
    d = tmp_path_factory.mktemp("long") / "llama2048"
    shutil.copytree(model, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    return d


def test_default_prompt_limit_is_the_models_context(tmp_path, long_model):
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 150)  # > 1024 tokens
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [text]})
    run_job(src, tmp_path / "out", long_model, "--max-new-tokens", 2)
    [row] = read_output(tmp_path / "out").to_pylist()
    assert row["error"] is None and 1024 < row["prompt_tokens"] <= 2046


def test_max_model_len_bounds_prompt_and_output(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog", LONG]})
    flags = ("--max-model-len", 32, "--max-new-tokens", 8, "--ignore-eos")
    run_job(src, tmp_path / "skip", model, *flags)
    rows = rows_by_id(tmp_path / "skip")
    short, long = rows[0], rows[1]
    assert short["error"] is None and short["completion_tokens"] == 8
    assert "--max-model-len 32" in long["error"] and "max_prompt_len 24" in long["error"]
    run_job(src, tmp_path / "cut", model, *flags, "--truncate", "left")
    rows = rows_by_id(tmp_path / "cut")
    assert [rows[0]["error"], rows[1]["error"]] == [None, None]
    assert rows[1]["prompt_tokens"] + rows[1]["completion_tokens"] == 32


def test_max_prompt_len_lower_than_the_model_len_wins(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": [LONG]})
    run_job(
        src,
        tmp_path / "out",
        model,
        "--max-model-len",
        64,
        "--max-prompt-len",
        10,
        "--max-new-tokens",
        4,
    )
    [row] = read_output(tmp_path / "out").to_pylist()
    assert "max_prompt_len 10 (set by --max-prompt-len)" in row["error"]


def test_max_model_len_refusals(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog"]})
    r = run_job(src, tmp_path / "a", model, "--max-model-len", 100000, exit_code=2)
    assert_one_line_error(r, "max_model_len 100000", "max_position_embeddings")
    r = run_job(
        src, tmp_path / "b", model, "--max-model-len", 8, "--max-new-tokens", 8, exit_code=2
    )
    assert_one_line_error(r, "no room for a prompt", "--max-model-len 8")
    r = run_cli("run", src, "-o", tmp_path / "c", "--max-model-len", 1, exit_code=2)
    assert "--max-model-len" in r.stderr


def test_plan_shows_the_limits(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog"]})
    args = ("plan", src, "--model", model, "--device", "cpu", "--max-new-tokens", 6)
    plan = json.loads(run_cli(*args, "--max-model-len", 40, "--json").stdout)
    assert (plan["max_model_len"], plan["max_prompt_len"]) == (40, 34)
    assert "prompt <= 250 tokens, prompt + output <= 256" in run_cli(*args).stdout
