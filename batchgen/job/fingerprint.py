"""What makes two runs the same job, stored in _job.json: a rerun whose fingerprint differs is
refused (or, with --overwrite, starts again), one that matches resumes.

`job_fingerprint(job)` is built once, from the opened job, in one place: the options that change
outputs (`options_fingerprint`), what they resolved to (the id column, the JSON schema's text
from the job's constraint, the LoRA adapter's hash from the spec's adapter) and what the job's
files were when it started.

The options alone say which paths a job read, not what was in them. Rerunning after the
weights at the same --model path were replaced, or after rows were prepended to the input,
would resume with the old rows kept and the new ones computed from other data, a silent mix.
So the fingerprint also records:

  - the model: a sha256 of every small file batchgen reads (config.json, the generation
    config, the tokenizer files, the chat template), and the name, size and mtime of every
    weights file (hashing gigabytes of weights would cost more than some jobs);
  - the input: the path, size and mtime of every input file.

A rewrite in place changes the mtime even where the size stays, and nothing is read beyond the
small files, so this costs milliseconds. A copy of the same files with new mtimes counts as a
change: the fix (--overwrite, or a new output) is named where the mismatch is refused.

What the weights became is known only once the model is loaded: int4 judges each layer by its
input width on a rank, so a layer that tensor parallelism splits to a width no group size
divides is kept at int8 (quant/quantize.py), and `-tp 2` and `-tp 1` of the same options load
two different models. Every part file records the scheme its rows were made with; after the
load, `check_weights` compares the effective per-layer scheme (`effective_weights`) with the
last part's and refuses a resume that would mix two models in one output.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.choices import Task
from batchgen.data import InputSource
from batchgen.engine.sequence import ConstraintKind
from batchgen.errors import InputError
from batchgen.job.config import RunConfig, choice_fields

if TYPE_CHECKING:
    from batchgen.data import OutputDir
    from batchgen.job.open import Job

# Small files of a model directory that change its outputs: hashed in full.
MODEL_TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")


# Options that change how a job runs, not what it writes: a rerun may change them.
RUN_ONLY_OPTIONS = frozenset(
    {
        "overwrite",
        "quiet",
        "rows_per_part",
        "flush_seconds",
        "window_rows",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_tokens",
        "prefix_caching",
        "compile",
        "compile_cache",
        "workers",
        "threads",
        "output_format",
        "tensor_parallel_size",
        "model_impl",  # native or transformers: the same tokens (tests/test_hf_backend.py)
        "peak_tflops",
        "peak_bandwidth_gbs",
        "max_error_rate",
        "progress_seconds",
    }
)

# vLLM's penalties switched off: a job's fingerprint holds them only when on
PENALTIES_OFF = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
}


def job_fingerprint(job: Job) -> dict[str, Any]:
    """The fingerprint of an opened job: its options and what they resolved to."""
    out = options_fingerprint(job.cfg)
    constraint = job.prep.options.defaults.constraint
    if constraint is not None and constraint.kind is ConstraintKind.JSON_SCHEMA:
        # the schema itself: editing the file makes another job
        out["json_schema"] = {"path": out["json_schema"], "schema": constraint.spec}
    if job.spec.lora is not None:  # the adapter's content: retraining it in place makes another job
        out["lora"] = {"path": out["lora"], "sha256": job.spec.lora.sha256}
    out["id_column"] = job.prep.id_column  # as resolved: an input's `id` column without --id-column
    out["model_files"] = model_files(job.spec.model_dir)
    out["input_files"] = input_files(job.source)
    return out


def options_fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """The options that change a job's outputs, with paths made absolute. Options at their
    default that older versions did not have are left out, so a job keeps the fingerprint it
    had before they existed."""
    out = {k: getattr(cfg, k) for k in RunConfig.field_names() if k not in RUN_ONLY_OPTIONS}
    out["input"] = str(Path(cfg.input).resolve()) if "*" not in cfg.input else cfg.input
    out["output"] = str(Path(cfg.output).resolve())
    out.update((k, getattr(cfg, k).value) for k in choice_fields() if k in out)
    for key in ("choice", "regex", "json_schema", "lora"):  # unconstrained jobs keep theirs
        if out[key] is None:
            del out[key]
    for key in ("json_schema", "lora"):
        if key in out and not str(out[key]).lstrip().startswith("{"):  # a path, not inline JSON
            out[key] = str(Path(out[key]).resolve())
    if cfg.n == 1:  # so do jobs of one sample a row
        del out["n"]
    if cfg.task is Task.GENERATE:  # and generating jobs
        del out["task"]
    if not cfg.prompt_logprobs:  # and jobs without prompt alternatives
        del out["prompt_logprobs"]
    for key, off in (("pooling", "auto"), ("embedding_dtype", "float32")):  # and non-embed jobs
        if out[key] == off:
            del out[key]
    for key in ("normalize", "dimensions"):
        if out[key] is None:
            del out[key]
    if not cfg.n_as_list:  # and jobs of a record per sample
        del out["n_as_list"]
    if not cfg.with_timings:  # and jobs without timing columns
        del out["with_timings"]
    if not cfg.with_stop_reason:  # and jobs without a stop_reason column
        del out["with_stop_reason"]
    if not cfg.json_any_whitespace:  # and jobs of compact JSON
        del out["json_any_whitespace"]
    for key in ("stop_token_ids", "min_tokens", "min_p"):  # and jobs without these (issue 31)
        if not out[key]:
            del out[key]
    for key, off in PENALTIES_OFF.items():  # and jobs without penalties
        if out[key] == off:
            del out[key]
    if "logit_bias" in out:  # keys as job.json reads back: strings
        out["logit_bias"] = {str(t): b for t, b in out["logit_bias"].items()}
    if cfg.shard:  # and unsharded runs
        out["shard"] = str(cfg.shard)
    else:
        del out["shard"]
    return out


def model_files(model_dir: Path) -> dict[str, Any]:
    """{name: "sha256:..."} for the small files, {name: [size, mtime_ns]} for the weights."""
    out: dict[str, Any] = {}
    for name in sorted(os.listdir(model_dir)):
        path = model_dir / name
        if not path.is_file():
            continue
        if name in MODEL_TEXT_FILES:
            out[name] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        elif name.endswith(WEIGHT_SUFFIXES):
            out[name] = _stat(path)
    return out


def input_files(source: InputSource) -> list[list[Any]]:
    """[[absolute path, size, mtime_ns], ...] in the order the input reads them."""
    return [[os.path.abspath(f), *_stat(Path(f))] for f in source.files]


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def effective_weights(quantization: dict[str, Any]) -> dict[str, str]:
    """How each quantized layer's weights are stored, from a scheme's `to_dict()` (as stats and
    every part file record it): {"layers.*.mlp.w_out": "int8 per channel (torchao)", ...}."""
    method = quantization.get("method", "none")
    if method == "none":
        return {}
    how = {m: f"{method} per channel" for m in quantization.get("modules", ())}
    how.update(
        (m, f"{method}, group of {g}") for m, g in quantization.get("group_sizes", {}).items()
    )
    how.update((m, "int8 per channel") for m in quantization.get("int8_layers", {}))
    return {m: f"{v} ({quantization.get('backend')})" for m, v in sorted(how.items())}


def check_weights(out: OutputDir, quantization: dict[str, Any]) -> None:
    """Refuse (InputError) to add rows made with weights stored otherwise than the output's
    rows so far: each resume checks, so the last part file speaks for them all."""
    parts = out.part_files()
    if not parts:
        return
    import pyarrow.parquet as pq

    meta = pq.read_schema(os.path.join(out.path, parts[-1])).metadata or {}
    stored = json.loads(meta.get(b"batchgen", b"{}")).get("quantization")
    if stored is None:  # an empty last part of an older batchgen: nothing to compare with
        return
    before, now = effective_weights(stored), effective_weights(quantization)
    diff = [
        f"{m}: {before.get(m, 'not quantized')} there, {now.get(m, 'not quantized')} now"
        for m in sorted(before.keys() | now.keys())
        if before.get(m) != now.get(m)
    ]
    if diff:
        raise InputError(
            f"output {out.path} holds rows made with other weights ({'; '.join(diff)}); int4 "
            "fits each layer's groups (or int8) to its width on a rank, which the tensor-parallel "
            "size changes: resume with the earlier run's --tensor-parallel-size (its stats.json "
            "says which), or pass --overwrite, or pick another output directory"
        )
