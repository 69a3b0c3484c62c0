"""Task embed's options, resolved once for a job (or an `LLM.embed` call): the pooling (the
flag, else the sentence-transformers checkpoint's own, else the last token's), whether to
normalize, Matryoshka `dimensions`, the instruction prefix; and a pooled vector -> the row's
embedding: truncated to `dimensions`, then L2-normalized (the order Matryoshka embeddings are
meant to be used in; sentence-transformers' `truncate_dim` with `normalize_embeddings`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgen.engine.params import Pooling
from batchgen.errors import ConfigError, ModelLoadError
from batchgen.model.st_config import read_st_embedding


@dataclass(frozen=True, slots=True)
class EmbedOptions:
    pooling: Pooling
    normalize: bool
    dimensions: int | None  # None: the model's hidden size
    prompt: str = ""  # put before each text (a sentence-transformers default prompt)

    def finish(self, pooled: list[float]) -> np.ndarray:
        """The row's embedding (float32) from its pooled vector."""
        v = np.asarray(pooled, dtype=np.float32)[: self.dimensions]
        if self.normalize:  # as torch.nn.functional.normalize: x / max(||x||, 1e-12)
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v


def embed_options(
    model_dir: str | Path,
    hidden_size: int,
    pooling: str | Pooling | None = None,
    normalize: bool | None = None,
    dimensions: int | None = None,
) -> EmbedOptions:
    """The options given (None: not given) over the checkpoint's own. ConfigError for a bad
    pooling name or dimensions outside 1..hidden_size."""
    st = read_st_embedding(model_dir)
    if pooling is None and st is not None and st.refused:
        raise ModelLoadError(st.refused)
    if pooling is None:
        pooling = (st and st.pooling) or Pooling.LAST.value
    try:
        mode = Pooling(pooling)
    except ValueError:
        mode = None
    if mode is None or mode is Pooling.CLASSIFY:
        raise ConfigError(f"pooling must be one of last, mean, cls; got {pooling!r}")
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise ConfigError(f"dimensions must be in [1, {hidden_size}] (the model's): {dimensions}")
    if normalize is None:
        normalize = bool(st and st.normalize)
    return EmbedOptions(mode, normalize, dimensions, st.prompt if st else "")
