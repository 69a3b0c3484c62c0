"""Command-line traps of a new user (issue 31 D, E): `\\n` in --stop/--template, and --n under
greedy decoding."""

from __future__ import annotations

import json
import subprocess

from helpers import EAGER, cli_command, read_job, run_job, write_parquet


def test_backslash_escapes_on_the_command_line(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"text": ["great product"]})
    out = tmp_path / "out"
    escaped = ("--template", r"Review: {{ text }}\nSentiment:", "--stop", r"\n", "--stop", r"a\\b")
    run_job(src, out, model, *escaped, "--max-new-tokens", 2)
    job = read_job(out)
    text = json.dumps(job)
    assert "Review: {{ text }}\\nSentiment:" in text  # a real newline, JSON-escaped
    assert "Review: {{ text }}\\\\nSentiment:" not in text
    assert '"\\n"' in text and '"a\\\\b"' in text


def test_n_under_greedy_warns_once_naming_temperature(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": ["the lazy dog", "the quick fox"]})

    def stderr(out, *flags):
        cmd = cli_command("run", src, "-o", tmp_path / out, "--model", model, *EAGER, *flags)
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr

    err = stderr("out", "--n", 3, "--max-new-tokens", 2)  # not --quiet: warnings show
    lines = [x for x in err.splitlines() if "identical completions" in x]
    assert len(lines) == 1 and "--temperature" in lines[0]
    err = stderr("out2", "--n", 3, "--temperature", 0.8, "--max-new-tokens", 2)
    assert "identical completions" not in err
