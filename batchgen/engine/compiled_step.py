"""A compiled step: one graph for every batch size, a CUDA graph per capture size on a GPU.

Compiled with static shapes, each padded batch size is a full inductor compile of the whole
model: measured on an H200 with a 24-layer 0.5B model (torch 2.11), 42 s a size, so a GPU job
spent its first minutes compiling. Here the axes that vary between steps (the batch, and the
inputs that only the attention op reads: table width, flex mask rows) are marked dynamic, as
the caller lists them: dynamo traces once with symbolic sizes (2 and up: sizes of 1 are
padded away), inductor compiles that one graph, and on CUDA its CUDA-graph trees record one
graph per size met, a capture rather than a compile (vLLM's capture sizes). The attention
is a custom op opaque to inductor (model/decode_ops.py), so the graph never depends on the
attention kernel's shape rules.

If the symbolic graph cannot be compiled anyway (a graph that pins the batch), the marks are
cleared from the step's tensors, the step runs through a second, static compile, and so do
the later ones, a graph per size: the job keeps running, with the old compile cost, named in
one warning.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence

import torch
import torch._dynamo
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from batchgen.model.paged_flex import unmark

log = logging.getLogger(__name__)

# A symbolic batch that cannot be: inductor failing to lower the graph (BackendCompilerFailed)
# or the graph pinning a marked axis to one size (ConstraintViolationError, or dynamo's
# UserError).
_DYNAMIC_FAILED = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.UserError,
    ConstraintViolationError,
)
# Per positional argument: the axes to mark dynamic (None: not a tensor, or static).
Dims = Sequence[tuple[int, ...] | None]


def _own_code(fn: Callable) -> Callable:
    """fn with a code object of its own. Dynamo keeps its graphs (and counts recompiles
    against its limit) per code object: with its own, each engine's step has its own graphs
    and count, instead of every engine in the process (two LLMs, a test suite) sharing one
    method's cache and its limit of 8."""
    func = fn.__func__ if isinstance(fn, types.MethodType) else fn
    own = types.FunctionType(
        func.__code__.replace(),
        func.__globals__,
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    return types.MethodType(own, fn.__self__) if isinstance(fn, types.MethodType) else own


class CompiledStep:
    """fn compiled with fullgraph, the axes `dims` names symbolic: one graph for every size
    (see the module's docstring), or after a failed symbolic compile one graph per size."""

    def __init__(self, fn: Callable, device: torch.device, dims: Dims) -> None:
        # CUDA graphs on a GPU (mode="reduce-overhead", whose one option this is), one recorded
        # per capture size: up to 34 of them at --max-num-seqs 256, on purpose, so without the
        # warning inductor gives past 8 sizes.
        cuda = device.type == "cuda"
        self.options = (
            {"triton.cudagraphs": True, "triton.cudagraph_dynamic_shape_warn_limit": None}
            if cuda
            else None
        )
        fn = _own_code(fn)
        self.code = (fn.__func__ if isinstance(fn, types.MethodType) else fn).__code__
        self.dims = tuple(dims)
        self.fn = torch.compile(fn, fullgraph=True, dynamic=None, options=self.options)
        self._static_of = fn
        self.dynamic = True  # False once the symbolic graph failed to compile

    @property
    def graphs(self) -> int:
        """Graphs compiled for this step so far (dynamo's cache entries of its own code): 1
        in steady state, whatever the sizes."""
        return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(self.code))

    def __call__(self, *args):
        if not self.dynamic:
            return self.fn(*args)
        marked = []
        for a, axes in zip(args, self.dims, strict=True):
            if axes is not None and isinstance(a, torch.Tensor):
                for axis in axes:
                    torch._dynamo.mark_dynamic(a, axis)
                marked.append(a)
        try:
            return self.fn(*args)
        except _DYNAMIC_FAILED as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning(
                "the decode step could not be compiled with a symbolic batch (%s): compiling "
                "one graph per batch size instead, a full compile each",
                first[:200],
            )
            self.dynamic = False
            for t in marked:
                unmark(t)
            self.fn = torch.compile(
                self._static_of, fullgraph=True, dynamic=False, options=self.options
            )
            return self.fn(*args)
