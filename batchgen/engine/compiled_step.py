"""A compiled decode step: one graph for every batch size, a CUDA graph per size on a GPU.

Decode batches are padded to powers of two, so a job with --max-num-seqs 256 meets up to 9
batch sizes. Compiled with static shapes, each is a full inductor compile of the whole model:
measured on an H200 with a 24-layer 0.5B model (torch 2.11), 42 s a size, so a GPU job spent
its first ~6 minutes compiling. Here the batch axis of every input is marked dynamic: dynamo
traces once with a symbolic batch (sizes of 2 and up; 1 is specialised by dynamo, so it is a
graph of its own), inductor compiles that one graph, and on CUDA its CUDA-graph trees record
one graph per size met, a capture rather than a compile (what vLLM does with its capture
sizes). The bounded set of shapes stays the padded sizes, and steady state compiles nothing.

If the symbolic graph cannot be compiled (a kernel template that needs a static batch, or a
graph that pins the batch), that step runs eagerly and every later one through one static
graph per size: the engine keeps running, with the old compile cost, and says so in a
warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import fields, is_dataclass

import torch
import torch._dynamo
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.nn.attention.flex_attention import BlockMask

log = logging.getLogger(__name__)

# The per-row tensors a flex block mask's mask_mod closes over (paged_flex.paged_block_mask):
# dynamo lifts them into the graph as inputs, so their batch axis is the batch too.
_MASK_ROW_TENSORS = ("tables", "lens")
_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices")
# A symbolic batch that cannot be: inductor failing to lower the graph (BackendCompilerFailed)
# or the graph pinning the batch to one size (ConstraintViolationError, or dynamo's UserError).
_DYNAMIC_FAILED = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.UserError,
    ConstraintViolationError,
)


def batch_tensors(args: tuple, batch: int) -> Iterator[torch.Tensor]:
    """Every tensor among args whose first axis is the batch: plain tensors, a dataclass's
    tensor fields (SamplingTensors), a flex BlockMask's per-row tensors and its mask_mod's."""
    for a in args:
        if isinstance(a, torch.Tensor):
            cand = [a]
        elif isinstance(a, BlockMask):
            cand = [getattr(a, n) for n in _MASK_TENSORS]
            fn = a.mask_mod
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
            cand += [cells[n].cell_contents for n in _MASK_ROW_TENSORS if n in cells]
        elif is_dataclass(a) and not isinstance(a, type):
            cand = [getattr(a, f.name) for f in fields(a)]
        else:
            continue
        yield from (t for t in cand if isinstance(t, torch.Tensor) and t.shape[:1] == (batch,))


class CompiledStep:
    """fn compiled with fullgraph, its first argument's first axis the batch: one dynamic graph
    for batches of 2 and more (see the module's docstring), or after a failed dynamic compile
    one static graph per batch size."""

    def __init__(self, fn: Callable, device: torch.device) -> None:
        mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs
        self.eager = fn
        self.fn = torch.compile(fn, fullgraph=True, dynamic=None, mode=mode)
        self.dynamic = True  # False once the symbolic graph failed to compile

    def __call__(self, *args):
        batch = args[0].shape[0]
        if self.dynamic and batch >= 2:
            for t in batch_tensors(args, batch):
                torch._dynamo.mark_dynamic(t, 0)
            try:
                return self.fn(*args)
            except _DYNAMIC_FAILED as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log.warning(
                    "the decode step could not be compiled for a dynamic batch (%s): "
                    "compiling one graph per batch size instead",
                    first[:200],
                )
                self.dynamic = False
                return self.eager(*args)  # this step's tensors carry the marks: run it eagerly
        # Static: batch 1 (dynamo's own specialisation), or every size after a fallback, where
        # automatic dynamic shapes stays off so that the failing symbolic graph is not retried.
        ctx = (
            nullcontext()
            if self.dynamic
            else torch._dynamo.config.patch(automatic_dynamic_shapes=False)
        )
        with ctx:
            return self.fn(*args)
