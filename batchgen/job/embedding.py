"""The pooled tasks' options, resolved once for a job (`pooled_task`) or an `LLM.embed` call
(`embed_options`): task embed's pooling (the flag, else the sentence-transformers checkpoint's
own, else the last token's), whether to normalize, Matryoshka `dimensions`, the instruction
prefix; task classify's labels (model/families/classifier_head.py). A pooled vector -> the row's
embedding: truncated to `dimensions`, then L2-normalized (the order Matryoshka embeddings are
meant to be used in; sentence-transformers' `truncate_dim` with `normalize_embeddings`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgen.choices import EmbeddingDtype, ModelImpl, PoolingChoice, Task
from batchgen.data.pooled_columns import PooledColumns, finish_embedding
from batchgen.engine.params import Pooling
from batchgen.errors import ConfigError, ModelLoadError
from batchgen.job.config import RunConfig
from batchgen.job.model_spec import ModelSpec
from batchgen.model.checkpoint.st_config import read_st_embedding


@dataclass(frozen=True, slots=True)
class EmbedOptions:
    pooling: Pooling
    normalize: bool
    dimensions: int | None  # None: the model's hidden size
    prompt: str = ""  # put before each text (a sentence-transformers default prompt)

    def finish(self, pooled: list[float]) -> np.ndarray:
        """The row's embedding (float32) from its pooled vector."""
        return finish_embedding(pooled, self.dimensions, self.normalize)


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


@dataclass(frozen=True, slots=True)
class PooledTask:
    """A job of task embed or classify: how its rows pool, its columns, the text put before
    each prompt (a sentence-transformers checkpoint's default prompt)."""

    pooling: Pooling
    columns: PooledColumns
    prefix: str = ""


def pooled_task(cfg: RunConfig, spec: ModelSpec) -> PooledTask | None:
    """The job's pooled task (None: it generates or scores). ConfigError for a model that
    cannot run it."""
    if not cfg.task.pooled:
        return None
    if spec.model_cfg.impl is ModelImpl.TRANSFORMERS:
        raise ConfigError(
            f"task {cfg.task.value} runs on batchgen's own decoder, not the transformers "
            "backend; pass --model-impl native (or auto) with a family batchgen runs"
        )
    if cfg.task is Task.CLASSIFY:
        labels = spec.model_cfg.labels
        if labels is None:
            raise ConfigError(
                f"task classify needs a classifier head: {spec.model_dir}/config.json's "
                "architectures name no *ForSequenceClassification"
            )
        return PooledTask(Pooling.CLASSIFY, PooledColumns(labels=labels))
    dim = spec.model_cfg.dim
    pooling = None if cfg.pooling is PoolingChoice.AUTO else cfg.pooling.value
    o = embed_options(spec.model_dir, dim, pooling, cfg.normalize, cfg.dimensions)
    f16 = cfg.embedding_dtype is EmbeddingDtype.FLOAT16
    return PooledTask(o.pooling, PooledColumns(o.dimensions or dim, o.normalize, f16), o.prompt)


def line_error(rec: dict, pooled: PooledTask | None) -> str | None:
    """Why an OpenAI batch line cannot run in this job (None: it can): /v1/embeddings lines
    run in a --task embed job, and only they do; a line's `dimensions` at most the job's
    embedding size (the model's, or --dimensions)."""
    embed_job = pooled is not None
    if rec["embeddings"] and not embed_job:
        return "url /v1/embeddings: an embeddings line runs in a --task embed job"
    if embed_job and not rec["embeddings"]:
        return "a completion line: a --task embed job runs /v1/embeddings lines only"
    dims = rec.get("dimensions")
    if pooled is not None and dims is not None and dims > pooled.columns.dimensions:
        size = pooled.columns.dimensions
        return f"dimensions {dims} is above this job's embedding size, {size}"
    return None
