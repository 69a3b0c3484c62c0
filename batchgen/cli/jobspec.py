"""Job spec files (YAML): the same keys as `batchgen run` flags, validated by RunConfig;
`build_config` lays the flags given on the line over a spec's values.

Paths starting with `builtin:` point inside the installed package's assets, so the
example jobs run wherever batchgen is installed (job/paths.py resolves them, for RunConfig).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import yaml

from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.job.paths import resolve_path


def is_job_spec(path: str) -> bool:
    return path.endswith((".yaml", ".yml"))


def load_job_spec(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job spec {path} does not exist")
    try:
        values = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"job spec {path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"job spec {path} must be a mapping of option: value")
    # max-new-tokens and max_new_tokens are one key, before flags are merged in by name
    spelled: dict[str, str] = {}
    for k in map(str, values):
        key = k.replace("-", "_")
        if key in spelled:
            raise ConfigError(
                f"job spec {path} sets {key} twice, as {spelled[key]!r} and {k!r}; keep one"
            )
        spelled[key] = k
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    for key in ("input", "output", "model"):
        if isinstance(values.get(key), str):
            values[key] = resolve_path(values[key])
    return values


# Flags whose backslash escapes (\n, \t, \\) are read on the command line, where a shell's
# "\n" is two characters: `--stop "\n"` stops at a newline. A job spec's YAML has its own.
ESCAPED = ("stop", "template")
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    """\\n, \\t and \\\\ as a newline, a tab and one backslash; any other backslash as it is."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def build_config(ctx: click.Context, source: str, **flags) -> RunConfig:
    """Job spec values (if SOURCE is a .yaml), overridden by flags given on the line."""
    values: dict = {}
    if is_job_spec(source):
        values = load_job_spec(source)
    else:
        values["input"] = resolve_path(source)
        if flags.get("input") is not None:
            raise ConfigError(f"input {source} and --input {flags['input']}: pass one of them")
    if flags.get("input") is not None:
        flags["input"] = resolve_path(flags["input"])
    for name, value in flags.items():
        # None: not one of this command's options (passed by the command itself)
        given = ctx.get_parameter_source(name) in (
            None,
            click.core.ParameterSource.COMMANDLINE,
            click.core.ParameterSource.ENVIRONMENT,
        )
        if given and name in ESCAPED and value is not None:
            value = (
                [unescape(v) for v in value] if isinstance(value, list | tuple) else unescape(value)
            )
        if given or name not in values:
            values[name] = value
    if "shard" in flags and values.get("shard") is None:
        values["shard"] = _shard_from_env(values.get("workers", 1))
    if isinstance(values.get("passthrough"), str):
        values["passthrough"] = [c.strip() for c in values["passthrough"].split(",") if c.strip()]
    if isinstance(values.get("choice"), str):  # "a, b,c" on the command line
        values["choice"] = [c.strip() for c in values["choice"].split(",")]
    if isinstance(values.get("stop"), tuple | list):
        values["stop"] = list(values["stop"])
    return RunConfig.from_mapping(values, source)


def _shard_from_env(workers) -> str | None:
    """The shard of a Slurm array task (SLURM_ARRAY_TASK_ID/COUNT), for runs without --shard."""
    from batchgen.job.shard import ShardError, shard_from_env

    try:
        shard = shard_from_env()
    except ShardError as e:
        raise ConfigError(str(e)) from None
    if shard is not None and str(workers) != "1":
        raise ConfigError(
            f"this is Slurm array task {shard} (SLURM_ARRAY_TASK_ID is set), which runs one shard; "
            "--workers splits a whole job, so use one or the other"
        )
    return str(shard) if shard else None
