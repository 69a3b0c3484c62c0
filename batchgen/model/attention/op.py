"""A layer's attention as one custom op, opaque to the compiler: the seam of the compiled
forward (engine/compiled_forward.py), and of the eager one, which runs the same code.

Why one op: a step mixes decodes and prefill chunks, and what each attends to (its block
table, its span of the step, the cached context before it) is data, different every step.
Traced into the graph, that data would become shapes and guards: a graph per mix of spans.
As an op, the graph sees only q, k and v (T, heads, D) and a layer number, and calls it like a
kernel; inside, the step's attention runs eagerly at its exact sizes (model/attention/step.py:
decodes over their blocks, gathered or read in place with flex, each prefill chunk over its
cached context and itself). This is vLLM's `unified_attention`, a `splitting_op`: the op is
tagged `cudagraph_unsafe`, so inductor's graph partitioning cuts the forward around it into
pieces that CUDA graphs capture (piecewise graphs), and the attention between them runs with
the step's real sizes.

What the op reads besides its arguments is the step: its StepAttention (masks built once per
window value and shared by every layer) and each layer's cache, parameters and window, bound
for the duration of one forward by `bound` (a context variable, as vLLM's forward context).
The graph never sees the KV pool either, so one graph (and one compile-cache entry) serves
every pool size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.sdpa import AttnParams
from batchgen.model.attention.step import StepAttention, step_attention


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention needs besides q, k and v."""

    cache: PagedKVCache
    params: AttnParams
    window: int | None  # the layer's sliding window (None: full attention)


@dataclass(frozen=True, slots=True)
class BoundStep:
    """One forward's attention context: the step with its masks per window value, and the
    layers' caches and parameters, by layer number."""

    steps: dict[int | None, StepAttention]
    layers: tuple[LayerAttention, ...]


_BOUND: ContextVar[BoundStep | None] = ContextVar("batchgen_step", default=None)


@contextlib.contextmanager
def bound(step: BoundStep) -> Iterator[None]:
    """The attention op reads `step` while the block runs (one forward)."""
    token = _BOUND.set(step)
    try:
        yield
    finally:
        _BOUND.reset(token)


def attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q (T, H, D), k, v (T, Hkv, D) of layer `layer` in the bound step -> (T, H, Dv): the
    keys/values written at the step's slots (the pool mutated in place: not an argument, so
    the graph does not hold it), then each token's attention. Rows past the step's decodes
    and prefill chunks (a compiled step's padding tokens) come back zero.

    The op's body, which an eager forward calls directly: through the dispatcher, torch runs a
    custom op's kernel inside `_disable_dynamo`, whose first call imports torch._dynamo (1.6
    CPU-s of an eager job's start on a 2-core CPU, with nothing compiled)."""
    step = _BOUND.get()
    if step is None:
        raise RuntimeError("batchgen::attention called outside a bound step (op.bound)")
    layer_ = step.layers[layer]
    # contiguous: a compiled graph may hand over views of other strides, which eager flex's
    # vmap over its mask cannot query ("NYI: querying is_contiguous inside of vmap")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    y = step_attention(q, k, v, layer_.cache, step.steps[layer_.window], layer_.params)
    return y.contiguous()


@torch.library.custom_op("batchgen::attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """attention_eager as one op, opaque to the compiler: what a compiled forward calls."""
    return attention_eager(q, k, v, layer)


@attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])
