"""Job spec files (YAML): the same keys as `batchgen run` flags, validated by RunConfig.

Paths starting with `builtin:` point inside the installed package's assets, so the
example jobs run wherever batchgen is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from batchgen.errors import ConfigError

ASSETS = Path(__file__).parents[1] / "assets"
BUILTIN = "builtin:"


def resolve_path(value: str) -> str:
    return str(ASSETS / value.removeprefix(BUILTIN)) if value.startswith(BUILTIN) else value


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
