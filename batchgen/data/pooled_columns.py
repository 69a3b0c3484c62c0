"""A pooled job's result columns, in place of the generated text: task embed's `embedding`
(a fixed-size list of float32, or float16: `pa.list_(type, dim)`, which pandas, pyarrow,
datasets and DuckDB read as an array column), and task classify's `label` and `probs` (the
softmax over the classifier head's labels), or for a one-label (reward) head `score`, its raw
logit. An embedding is its pooled vector truncated to `dimensions`, then L2-normalized where
asked (Matryoshka embeddings are meant to be cut, then normalized); whether they were is in the
embedding field's metadata (NORMALIZED_KEY), so a shorter cut made later (an OpenAI line's
`dimensions`) normalizes again only where the job did."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

EMBED_COLUMNS = ("embedding",)
CLASSIFY_COLUMNS = ("label", "probs")
REWARD_COLUMNS = ("score",)
NORMALIZED_KEY = b"batchgen.normalized"  # the embedding field's metadata: "true" or "false"


def finish_embedding(pooled: list[float], dimensions: int | None, normalize: bool) -> np.ndarray:
    """A row's embedding (float32) from its pooled vector."""
    v = np.asarray(pooled, dtype=np.float32)[:dimensions]
    if normalize:  # as torch.nn.functional.normalize: x / max(||x||, 1e-12)
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    w = [math.exp(x - top) for x in logits]
    total = math.fsum(w)
    return [x / total for x in w]


@dataclass(frozen=True, slots=True)
class PooledColumns:
    """The columns of task embed (dimensions > 0) or task classify (labels)."""

    dimensions: int = 0  # embed: the embedding's size, after truncation
    normalize: bool = False
    float16: bool = False  # embed: stored as float16
    labels: tuple[str, ...] = ()  # classify: the head's labels, in logit order

    @property
    def names(self) -> tuple[str, ...]:
        if self.dimensions:
            return EMBED_COLUMNS
        return REWARD_COLUMNS if len(self.labels) == 1 else CLASSIFY_COLUMNS

    def fields(self) -> list[pa.Field]:
        if self.dimensions:
            kind = pa.float16() if self.float16 else pa.float32()
            meta = {NORMALIZED_KEY: str(self.normalize).lower()}  # read by openai_output.py
            return [pa.field("embedding", pa.list_(kind, self.dimensions), metadata=meta)]
        if len(self.labels) == 1:
            return [pa.field("score", pa.float64())]
        return [pa.field("label", pa.string()), pa.field("probs", pa.list_(pa.float32()))]

    def record_fields(self, pooled: list[float] | None) -> dict[str, Any]:
        """A record's columns from its pooled vector (None: an error row's nulls)."""
        if pooled is None:
            return dict.fromkeys(self.names)
        if self.dimensions:
            v = finish_embedding(pooled, self.dimensions, self.normalize)
            return {"embedding": v.astype(np.float16 if self.float16 else np.float32)}
        if len(self.labels) == 1:
            return {"score": pooled[0]}
        probs = softmax(pooled)
        return {"label": self.labels[probs.index(max(probs))], "probs": probs}
