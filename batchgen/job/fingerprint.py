"""What a job's files were when it started, cheaply: stored in _job.json next to the options.

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
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from batchgen.data import InputSource

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


def content_fingerprint(model_dir: Path, source: InputSource) -> dict[str, Any]:
    return {"model_files": model_files(model_dir), "input_files": input_files(source)}


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
