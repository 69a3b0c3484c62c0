"""`LLM.embed` and `LLM.classify`, shaped as vLLM's: one `EmbeddingRequestOutput` per prompt
with `.outputs.embedding`, one `ClassificationRequestOutput` with `.outputs.probs` (and, as
batchgen adds, `.outputs.label`; a one-label reward head's raw logit in `.outputs.score`).
Both run prefill only, pooled rows (engine/pooling.py); nothing is sampled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.api.prompts import Prompt, as_prompt_list
from batchgen.data.pooled_columns import softmax
from batchgen.engine.params import DecodeParams, Pooling
from batchgen.engine.sequence import Completion, Request
from batchgen.errors import RequestError
from batchgen.job.embedding import embed_options


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (a one-label head: [1.0])
    label: str  # the likeliest's name (config.json's id2label)
    logits: list[float]  # the head's raw outputs
    score: float | None = None  # a one-label (reward) head: its raw logit

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's EmbeddingRequestOutput / ClassificationRequestOutput: one prompt's result."""

    index: int
    prompt_token_ids: list[int]
    outputs: Any  # EmbeddingOutput or ClassificationOutput
    completion: Completion  # the engine's record (timings, cached tokens)

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def finished(self) -> bool:
        return True


EmbeddingRequestOutput = ClassificationRequestOutput = PoolingRequestOutput


def classification(labels: Sequence[str], logits: list[float]) -> ClassificationOutput:
    """The head's logits as probabilities, the likeliest label and a reward head's score."""
    probs = softmax(logits)
    best = max(range(len(probs)), key=probs.__getitem__)
    score = logits[0] if len(logits) == 1 else None
    return ClassificationOutput(probs, labels[best], logits, score)


class PoolingCalls:
    """LLM's pooled calls (mixed into batchgen.llm.LLM, whose checker, spec and _run they use)."""

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding: its final hidden states pooled (pooling: last, mean or cls;
        None: the sentence-transformers checkpoint's own, else last), truncated to dimensions
        and L2-normalized where asked (None: where the checkpoint has a Normalize module)."""
        opts = embed_options(
            self.spec.model_dir, self.spec.model_cfg.dim, pooling, normalize, dimensions
        )
        ids, done = self._pooled(prompts, opts.pooling, opts.prompt, use_tqdm)
        return [
            PoolingRequestOutput(i, x, EmbeddingOutput(opts.finish(c.pooled).tolist()), c)
            for i, (x, c) in enumerate(zip(ids, done, strict=True))
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool = False
    ) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities from the checkpoint's classifier head (a
        *ForSequenceClassification model) on its last token."""
        labels = self.spec.model_cfg.labels
        if labels is None or getattr(self.model, "score", None) is None:
            raise RequestError(
                f"{self.spec.model_dir} has no classifier head (config.json's architectures "
                "name no *ForSequenceClassification); LLM.classify needs one"
            )
        ids, done = self._pooled(prompts, Pooling.CLASSIFY, "", use_tqdm)
        return [
            PoolingRequestOutput(i, x, classification(labels, c.pooled), c)
            for i, (x, c) in enumerate(zip(ids, done, strict=True))
        ]

    def _pooled(
        self, prompts: Prompt | Sequence[Prompt], pooling: Pooling, prefix: str, use_tqdm: bool
    ) -> tuple[list[list[int]], list[Completion]]:
        if not hasattr(self.model, "hidden"):
            raise RequestError(
                "embed and classify run on batchgen's own decoder, not the transformers "
                "backend; load the model with model_impl='native' (or auto)"
            )
        params = DecodeParams(pooling=pooling)
        ids, requests = [], []
        for i, p in enumerate(as_prompt_list(prompts)):
            if prefix and isinstance(p, str):
                p = prefix + p
            _, x = self._checker.prompt(i, p)
            ids.append(x)
            requests.append(Request(i, x, params, score_from=len(x)))
        done = self._run(requests, use_tqdm)
        for c in done:  # a row the engine could not run (its KV cache too small for it)
            if c.pooled is None:
                raise RequestError(f"prompt {c.index}: {c.error}")
        return ids, done
