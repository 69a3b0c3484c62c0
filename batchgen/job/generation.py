"""A job's generation defaults: the options given, else the model's generation_config.json,
else batchgen's own, each with where it came from (recorded in .batchgen/stats.json).

As vLLM's `generation_config="auto"`: a checkpoint's `max_new_tokens`, `temperature`, `top_p`
and `top_k` are its defaults, so a model shipped for 5 new tokens makes 5, as transformers'
generate does. `do_sample: false` means greedy (temperature 0), as in transformers; without
`do_sample` a temperature is taken as it is, as vLLM does. `max_length` is left alone: it
bounds prompt and output together, which --max-model-len does here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")
# batchgen's own, where neither an option nor the model sets one (vLLM's max_tokens is 16)
FALLBACK: dict[str, int | float] = {
    "max_new_tokens": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
}
GIVEN, MODEL, BATCHGEN = "option", "generation_config.json", "batchgen"


def _valid(key: str, v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    if key in ("max_new_tokens", "top_k"):  # past int64 no tensor holds it
        low = 1 if key == "max_new_tokens" else -1
        return isinstance(v, int) and low <= v < 2**63
    return v >= 0 if key == "temperature" else 0 < v <= 1


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """A model directory's generation_config.json as a dict ({} without one, or an unreadable
    one): read once a job (ModelSpec.generation_config), for EOS and the defaults."""
    path = Path(model_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply
        return {}
    return gen if isinstance(gen, dict) else {}


def model_defaults(gen: Mapping[str, Any]) -> dict[str, int | float]:
    """The generation defaults a model's generation_config.json (gen) sets; a value that
    could not be an option's (a negative temperature, top_p 0) is warned about and ignored."""
    path = "generation_config.json"
    found: dict[str, int | float] = {}
    for key in KEYS:
        v = gen.get(key)
        if v is None:
            continue
        if not _valid(key, v):
            log.warning("%s: ignoring %s %r, which is no %s option's value", path, key, v, key)
            continue
        found[key] = 0 if key == "top_k" and v == -1 else v
    if gen.get("do_sample") is False:  # transformers' greedy, whatever temperature it lists
        found["temperature"] = 0.0
    return found


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The job's values of KEYS and, per key, where each came from (GIVEN, MODEL, BATCHGEN)."""

    values: dict[str, int | float]
    sources: dict[str, str]

    @classmethod
    def resolve(cls, given: Mapping[str, Any], gen: Mapping[str, Any]) -> GenerationDefaults:
        """given: the options' values, None where not given; gen: the model's
        generation_config.json (read_generation_config)."""
        model = model_defaults(gen)
        values: dict[str, int | float] = {}
        sources: dict[str, str] = {}
        for key in KEYS:
            if given.get(key) is not None:
                values[key], sources[key] = given[key], GIVEN
            elif key in model:
                values[key], sources[key] = model[key], MODEL
            else:
                values[key], sources[key] = FALLBACK[key], BATCHGEN
        return cls(values, sources)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{key: {"value": v, "from": source}}: stats.json's `generation_defaults`."""
        return {k: {"value": self.values[k], "from": self.sources[k]} for k in KEYS}
