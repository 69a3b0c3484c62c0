"""Model FLOPs and bytes counted from the architecture, step by step: MFU and MBU.

FLOPs of a step (the whole model, over all tensor-parallel ranks), from its StepReport:

    2 * layer_params * tokens          every computed token through every decoder matrix (of a
                                       MoE layer: the router and the token's k experts)
  + 4 * layers * heads * head_dim * C  attention: Q.K^T and P.V over C, the sum over computed
                                       tokens of the keys each attends to (engine/step_cost.py)
  + 2 * head_params * head_rows       the head: the LM head (vocab x dim) for positions whose
                                       logits are used (a prompt-logprobs row's every prompt
                                       token but its last); a classify job's classifier head
                                       (labels x dim) once a row, in the step it finishes; an
                                       embed job's nothing (no head runs: engine/pooling.py)

Prefix-cache hits are not computed, so they do not count; nor do padding rows of a compiled
shape, nor steps that compiled a new shape (their time is compile time). MFU = the FLOPs over
the engine's step time (prefill_s + decode_s) / peak FLOP/s.

Bytes a decode-only step must read: every weight once at its stored precision (the input
embedding excepted where it is not the LM head: a gather of a few rows) plus the KV cache the
decoding rows attend to, kv_bytes_per_token * C. MBU is the time-weighted mean over decode
steps of bytes / step time / peak bandwidth, which is sum(bytes) / decode_s / peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.choices import Task
from batchgen.engine.sequence import StepReport
from batchgen.model.config import ModelConfig

# The head a job's rows run after the decoder (stats.json's `head`).
LM_HEAD, CLASSIFIER_HEAD, NO_HEAD = "lm", "classifier", "none"


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one token costs a decoder, from its architecture."""

    layer_params: int  # the decoder-block matrices a token runs through
    head_params: int  # the head's matrix: LM (vocab x dim), classifier (labels x dim), none 0
    kv_bytes_per_token: int  # all layers, K and V
    attn_width: int  # layers * heads * head_dim: attention FLOPs per key attended, / 4
    weight_bytes: int  # weights a decode step reads, at their stored precision
    head: str = LM_HEAD
    head_on_every_prompt_token: bool = False  # task prompt-logprobs: a prefill's every row

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        dtype_bytes: int,
        weight_bytes: int | None = None,
        task: Task = Task.GENERATE,
    ) -> ModelCost:
        """dtype_bytes: the KV cache's (the activations'); weight_bytes: the weights a decode
        step reads (default: the decoder blocks and the LM head at dtype_bytes); task: the
        job's, which decides the head its rows run."""
        layer_params = cfg.active_layer_params  # a MoE layer's router and k experts
        lm_head = cfg.vocab_size * cfg.dim
        if weight_bytes is None:  # every expert: a batch's rows pick most of them
            weight_bytes = (cfg.layer_params() + lm_head) * dtype_bytes
        head, head_params = LM_HEAD, lm_head
        if task is Task.EMBED:
            head, head_params = NO_HEAD, 0
        elif task is Task.CLASSIFY:
            head, head_params = CLASSIFIER_HEAD, len(cfg.labels or ()) * cfg.dim
        return cls(
            layer_params=layer_params,
            head_params=head_params,
            kv_bytes_per_token=cfg.kv_bytes_per_token(dtype_bytes),
            attn_width=cfg.n_layers * cfg.n_heads * cfg.head_dim,
            weight_bytes=weight_bytes,
            head=head,
            head_on_every_prompt_token=task is Task.PROMPT_LOGPROBS,
        )

    def flops(self, tokens: int, context_tokens: int, logits_rows: int) -> int:
        return (
            2 * self.layer_params * tokens
            + 4 * self.attn_width * context_tokens
            + 2 * self.head_params * logits_rows
        )

    def decode_bytes(self, context_tokens: int) -> int:
        return self.weight_bytes + self.kv_bytes_per_token * context_tokens

    def head_rows(self, r: StepReport) -> int:
        """The rows of a step through the head: a classifier's once a finished row (a pooled
        row samples nothing, so the step's logits_rows leave it out), else logits_rows."""
        return len(r.finished) if self.head == CLASSIFIER_HEAD else r.logits_rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_flops_per_token": 2 * (self.layer_params + self.head_params),
            "head_flops_per_row": 2 * self.head_params,  # only rows whose logits are used
            "head": self.head,
            "head_on_every_prompt_token": self.head_on_every_prompt_token,
            "weights_read_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


@dataclass(slots=True)
class Roofline:
    """The sum of the counted steps' FLOPs and time, and of the decode steps' bytes."""

    cost: ModelCost
    flops: int = 0
    seconds: float = 0.0  # of the counted steps
    decode_bytes: int = 0
    decode_seconds: float = 0.0

    def add(self, r: StepReport) -> None:
        if r.new_shape or r.seconds <= 0:  # a compile: not the model's speed
            return
        tokens = r.decode_rows + r.prompt_tokens
        self.flops += self.cost.flops(tokens, r.context_tokens, self.cost.head_rows(r))
        self.seconds += r.seconds
        if not r.prefill:
            self.decode_bytes += self.cost.decode_bytes(r.context_tokens)
            self.decode_seconds += r.seconds

    def summary(self, peak_flops: float | None, peak_bandwidth: float | None) -> dict[str, Any]:
        """stats.json's model_flops, decode_bytes_read, mfu and mbu (None where unknown)."""
        achieved = self.flops / self.seconds if self.seconds else None
        bw = self.decode_bytes / self.decode_seconds if self.decode_seconds else None
        return {
            **self.cost.to_dict(),
            "model_flops": self.flops,
            "model_flops_s": self.seconds,
            "decode_bytes_read": self.decode_bytes,
            "decode_bytes_s": self.decode_seconds,
            "mfu": achieved / peak_flops if achieved and peak_flops else None,
            "mbu": bw / peak_bandwidth if bw and peak_bandwidth else None,
        }


def compute_ceiling_s(stats: dict[str, Any], tokens: float, logits_rows: float) -> float | None:
    """The least time a step's matmuls take at the peak (attention left out): `tokens`
    computed tokens through the decoder, `logits_rows` of them through the head (a prefill
    step runs the LM head for a prompt's last token only, a prompt-logprobs job's for every
    token; a pooled job's head: a classifier's or none). From stats.json's keys; None without
    a peak.
    An older stats.json, without head_flops_per_row, charges the head for every token."""
    peak, per_token = stats.get("peak_flops"), stats.get("model_flops_per_token")
    if not peak or not per_token:
        return None
    head = stats.get("head_flops_per_row")
    if head is None:
        return per_token * tokens / peak
    return ((per_token - head) * tokens + head * logits_rows) / peak
