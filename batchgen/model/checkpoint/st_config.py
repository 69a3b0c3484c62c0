"""A sentence-transformers checkpoint's own description of its embedding: `modules.json` lists
its modules (the Transformer, a Pooling, a Normalize ...), `1_Pooling/config.json` (the
Pooling module's folder) its mode, and `config_sentence_transformers.json` the prompts it was
trained with and the one `encode` puts before every text by default. Task embed reads them so
a job pools as `SentenceTransformer(dir).encode` does; its flags override them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from batchgen.errors import ModelLoadError

# A Pooling config's modes -> batchgen's (the ones decoder embedding models use): written as
# one "pooling_mode" (sentence-transformers 5) or as a flag each (pooling_mode_<name>: true)
_MODES = {
    "lasttoken": "last",
    "mean": "mean",
    "mean_tokens": "mean",
    "cls": "cls",
    "cls_token": "cls",
}


@dataclass(frozen=True, slots=True)
class StEmbedding:
    pooling: str | None  # "last", "mean", "cls"; None: modules.json has no Pooling module
    normalize: bool  # a Normalize module follows the pooling
    prompt: str = ""  # the default prompt encode puts before each text
    refused: str | None = None  # why its pooling is not one batchgen runs (a flag may choose)


def read_st_embedding(model_dir: str | Path) -> StEmbedding | None:
    """The checkpoint's sentence-transformers description (None: not a sentence-transformers
    checkpoint). ModelLoadError for modules batchgen does not run (a Dense projection); a
    pooling mode other than last, mean or cls is `refused`."""
    root = Path(model_dir)
    if not (root / "modules.json").is_file():
        return None
    pooling, normalize, refused = None, False, None
    for m in json.loads((root / "modules.json").read_text()):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            try:
                pooling = _pooling_mode(root / m.get("path", "") / "config.json")
            except ModelLoadError as e:
                refused = str(e)
        elif kind not in ("Transformer", "Pooling"):
            raise ModelLoadError(
                f"{root / 'modules.json'} has a {kind} module, which batchgen does not run "
                "(it runs Transformer, Pooling and Normalize); embed with sentence-transformers"
            )
    return StEmbedding(pooling, normalize, _default_prompt(root), refused)


def _pooling_mode(path: Path) -> str:
    cfg = json.loads(path.read_text())
    mode = cfg.get("pooling_mode")
    if not isinstance(mode, str):
        on = [
            k.removeprefix("pooling_mode_")
            for k, v in cfg.items()
            if k.startswith("pooling_mode_") and v
        ]
        mode = on[0] if len(on) == 1 else str(on)
    if mode not in _MODES:
        raise ModelLoadError(
            f"{path}: pooling {mode!r} is not one batchgen runs (lasttoken, mean or cls); "
            "pass --pooling to choose one"
        )
    if not cfg.get("include_prompt", True) and _MODES[mode] != "last":
        raise ModelLoadError(
            f"{path}: include_prompt false (the prompt's tokens left out of the {mode} pooling) "
            "is not run by batchgen; embed with sentence-transformers"
        )
    return _MODES[mode]


def _default_prompt(root: Path) -> str:
    path = root / "config_sentence_transformers.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    name = cfg.get("default_prompt_name")
    return str((cfg.get("prompts") or {}).get(name, "")) if name else ""
