"""Issue 31: `run --help` lists its options in sections, the common ones first, -o on the
first screen, each option once, with its default."""

from __future__ import annotations

import re

import click
import pytest
from helpers import run_cli

from batchgen.cli.help import SECTIONS
from batchgen.cli.main import plan_cmd, run_cmd


def _help(command: str) -> list[str]:
    return run_cli(command, "--help").stdout.splitlines()


def test_run_help_has_sections_and_output_on_the_first_screen():
    lines = _help("run")
    for title in SECTIONS:
        assert f"{title} options:" in lines
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("-o, --output"))
    assert first < 40, "\n".join(lines[: first + 1])
    other = lines[lines.index("Other options:") + 1 :]
    assert [x.split()[0] for x in other if x.startswith("  -")] == ["-h,"]


@pytest.mark.parametrize("command", [run_cmd, plan_cmd])
def test_every_option_appears_once(command):
    text = "\n".join(_help(command.name))
    ctx = click.Context(command)
    records = [p.get_help_record(ctx) for p in command.get_params(ctx)]
    firsts = [r[0] for r in records if r is not None]  # "-o, --output TEXT"; not SOURCE
    assert len(firsts) > 10
    for first in firsts:
        found = re.findall(rf"^  {re.escape(first)}(?:\s|$)", text, flags=re.M)
        assert len(found) == 1, (first, len(found))


def test_defaults_are_shown():
    text = " ".join(" ".join(_help("run")).split())
    assert "--seed INTEGER RANGE" in text
    seed = text[text.index("--seed INTEGER") :]
    assert "[default: 0;" in seed[: seed.index("--stop")]
    for first in (
        "--temperature FLOAT",
        "--top-k INTEGER",
        "--top-p FLOAT",
        "--max-new-tokens INT",
    ):
        part = text[text.index(first) :][:400]
        assert "generation_config.json" in part, first
