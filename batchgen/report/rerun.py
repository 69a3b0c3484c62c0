"""The command that reruns a job, from its job.json: `batchgen run INPUT -o OUTPUT` and each
option job.json holds, as its flag. job.json is the job's fingerprint (job/fingerprint.py), so
the command makes the same job: run again, it resumes or finds every row done. Options left
out of job.json (threads, engine sizes, compile) do not change the output; the default model
(`model: null`) is the one a command without --model runs."""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

from batchgen.job.config import RunConfig

# job.json keys that are not options (the files' fingerprints), or that are the positional
# input and -o
_NOT_FLAGS = {"input", "output", "input_files", "model_files"}
_COMMA_LISTS = {"passthrough", "choice"}  # "a,b" on the command line; the others repeat
_ESCAPED = {"stop", "template"}  # the CLI reads \n, \t, \\ in them (cli/jobspec.py)


def _defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(RunConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = getattr(f.default, "value", f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def _flags(key: str, value: Any, default: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, dict) and "path" in value:  # json_schema, lora: the file and its hash
        value = value["path"]
    if value is None or value == default:
        return []
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + key.replace("_", "-")]
    if isinstance(value, dict):  # logit_bias
        return [flag, json.dumps(value, separators=(",", ":"))]
    if isinstance(value, list):
        if key in _COMMA_LISTS:
            return [flag, ",".join(map(str, value))]
        items = [_escape(v) if key in _ESCAPED else str(v) for v in value]
        return [w for v in items for w in (flag, v)]
    return [flag, _escape(value) if key in _ESCAPED else str(value)]


def rerun_command(job: dict[str, Any], merged: bool = False) -> str:
    """The `batchgen run` command of job.json's job (merged: a merged job's, from its shard 0's
    job.json: one run per shard, then merge), with a note where a flag cannot hold a value
    exactly (a --choice label with a comma or outer spaces: a job spec's list can)."""
    output = str(job.get("output", "?"))
    words = ["batchgen", "run", str(job.get("input", "?")), "-o", output]
    defaults = _defaults()
    shards = str(job.get("shard", "")).partition("/")[2]
    if merged and shards:
        job = {**job, "shard": f"I/{shards}"}
    for key, value in job.items():
        if key not in _NOT_FLAGS and key in defaults:
            words += _flags(key, value, defaults[key])
    line = shlex.join(words)
    if merged and shards:
        line += f"\n# once for each shard I = 0 to {int(shards) - 1}, then: "
        line += shlex.join(["batchgen", "merge", output])
    labels = job.get("choice") or []
    if any("," in c or c != c.strip() for c in labels):
        line += f"\n# --choice cannot hold these labels exactly; a job spec can: choice: {labels}"
    return line
