"""Paths a job names: `builtin:` ones resolved into the package's assets, and the kinds of
path batchgen cannot write or read (object-store URLs, an output named like a file) refused
with the form that works. RunConfig applies both, so the CLI and the Python API agree."""

from __future__ import annotations

import re
from pathlib import Path

from batchgen.errors import ConfigError

# Paths starting with `builtin:` point inside the installed package's assets, so the example
# jobs (and the Python API's RunConfig(input="builtin:samples/...")) run wherever batchgen is.
ASSETS = Path(__file__).parents[1] / "assets"
BUILTIN = "builtin:"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# What `-o results.jsonl` (vllm run-batch's habit) means here: a file, where batchgen writes a
# directory of parts.
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def resolve_path(value: str) -> str:
    """A `builtin:` path as a path in the package's assets; any other path as it is."""
    return str(ASSETS / value.removeprefix(BUILTIN)) if value.startswith(BUILTIN) else value


def check_local_paths(input: str, output: str, results_file: bool = False) -> None:
    """Refuse object-store URLs (which would become local folders named `s3:`) and an output
    named like a file (batchgen writes a directory of part files), unless it is the OpenAI
    batch output file (results_file: RunConfig.results_path)."""
    for key, path in (("input", input), ("output", output)):
        if _URL.match(path):
            fix = "write to a local directory, then copy it" if key == "output" else "copy it here"
            raise ConfigError(
                f"{key} {path}: object stores and URLs are not supported yet; {fix} "
                "(e.g. with `aws s3 cp --recursive`)"
            )
    if output.rstrip("/").lower().endswith(_FILE_SUFFIXES) and not results_file:
        raise ConfigError(
            f"output {output} names a file, but batchgen writes a directory of Parquet parts; "
            "pass a directory, e.g. `-o OUT` (or, for OpenAI batch output lines as vllm "
            "run-batch writes them, `--output-format openai -o results.jsonl`)"
        )


def names_results_file(output: str) -> bool:
    """`-o results.jsonl`: a JSON Lines file, vllm run-batch's output."""
    return output.rstrip("/").lower().endswith(".jsonl") and not output.endswith("/")
