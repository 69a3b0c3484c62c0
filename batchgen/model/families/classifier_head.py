"""A `*ForSequenceClassification` checkpoint's head (Llama's, Qwen2's, ...): `score`, a
Linear(dim, num_labels) without bias, which transformers runs on the last prompt token's
hidden state after the final norm; its labels are config.json's `id2label`. A one-label head
is a reward model's: its raw logit is the row's score. The loader adds the head where
config.json's architectures name one (`ModelConfig.labels`; task classify reads it through
engine/pooling.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def classifier_labels(hf: dict[str, Any]) -> tuple[str, ...] | None:
    """The labels of a config.json's classifier head, in logit order (None: no head)."""
    if not any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures", [])):
        return None
    id2label = {str(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
    n = int(hf.get("num_labels") or len(id2label) or 2)
    return tuple(id2label.get(str(i), f"LABEL_{i}") for i in range(n))


def add_classifier_head(model: nn.Module, num_labels: int) -> None:
    """Give the model (built on the meta device, before its weights) its `score` head."""
    from torch import nn  # here: config.json's reader (hf_config.py) imports no torch

    model.score = nn.Linear(model.cfg.dim, num_labels, bias=False)
