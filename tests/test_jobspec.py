"""`batchgen run JOB.yaml`: spec values, flags that override them, and clear errors."""

import json

import pytest
import yaml
from helpers import prompts, read_job, rows_by_id, run_cli, write_parquet

LONG = "the quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture
def spec(tmp_path, tiny_dirs):
    """Write a job spec of the given values over a small input; returns its path."""
    src = write_parquet(tmp_path / "in.parquet", {"text": [*prompts(4), LONG]})

    def write(**values):
        base = {
            "input": str(src),
            "output": str(tmp_path / "out"),
            "model": str(tiny_dirs["llama"]),
            "template": "Review: {{ text }}",
            "max_new_tokens": 3,
            "ignore_eos": True,
            "max_prompt_len": 16,
            "max_error_rate": 1.0,  # the long row is an error row on purpose: 1 in 5
            "device": "cpu",
            "compile": False,
            "kv_cache_tokens": 4096,
            "quiet": True,
        }
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump({**base, **values}))
        return path

    return write


def test_spec_values_are_used(tmp_path, spec):
    run_cli("run", spec())
    rows = rows_by_id(tmp_path / "out")
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert [rows[i]["completion_tokens"] for i in range(4)] == [3] * 4  # max_new_tokens, ignore_eos
    assert "max_prompt_len" in rows[4]["error"]  # max_prompt_len 16, default --truncate skip


def test_flags_override_the_spec(tmp_path, spec):
    run_cli("run", spec(), "--max-new-tokens", 5, "-o", tmp_path / "other", "--truncate", "left")
    assert not (tmp_path / "out").exists()
    rows = rows_by_id(tmp_path / "other")
    assert [r["completion_tokens"] for r in rows.values()] == [5] * 5
    assert read_job(tmp_path / "other")["max_new_tokens"] == 5


def test_a_flag_given_at_its_default_still_overrides(spec):
    """--max-prompt-len 1024 is the default value, but given on the line it beats the spec's 16."""
    path = spec()
    assert json.loads(run_cli("plan", path, "--json").stdout)["rows_error"] == 1
    report = json.loads(run_cli("plan", path, "--max-prompt-len", 1024, "--json").stdout)
    assert report["rows_error"] == 0 and report["rows"] == 5


def test_dashed_keys_are_accepted(tmp_path, spec):
    path = spec()
    values = yaml.safe_load(path.read_text())
    values["max-new-tokens"] = values.pop("max_new_tokens")
    path.write_text(yaml.safe_dump(values))
    run_cli("run", path)
    rows = rows_by_id(tmp_path / "out")
    assert [rows[i]["completion_tokens"] for i in range(4)] == [3] * 4


def test_unknown_key_names_it_and_lists_the_allowed_keys(spec):
    r = run_cli("run", spec(max_new_tokenz=3), exit_code=2)
    assert "unknown key(s) max_new_tokenz" in r.stderr
    assert "allowed:" in r.stderr
    for key in ("input", "output", "max_new_tokens", "template", "truncate"):
        assert key in r.stderr.split("allowed:")[1]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("input: [unclosed", ["not valid YAML"]),
        ("- just\n- a list\n", ["must be a mapping"]),
        (None, ["does not exist"]),
    ],
)
def test_bad_spec_files(tmp_path, text, words):
    path = tmp_path / "job.yaml"
    if text is not None:
        path.write_text(text)
    r = run_cli("run", path, exit_code=2)
    for w in words:
        assert w in r.stderr


def test_bad_values_in_a_spec(spec):
    assert "missing output" in run_cli("run", spec(output=None), exit_code=2).stderr
    r = run_cli("run", spec(max_new_tokens=0), exit_code=2)
    assert "max_new_tokens must be >= 1" in r.stderr
    r = run_cli("run", spec(truncate="middle"), exit_code=2)
    assert "truncate" in r.stderr and "left" in r.stderr


def test_builtin_paths_point_into_the_package(spec):
    r = run_cli("run", spec(input="builtin:samples/no-such.parquet"), exit_code=2)
    assert "batchgen/assets/samples/no-such.parquet" in r.stderr
