"""The compiled forward: every step, prefill chunks and decodes alike, through one graph.

- The model's `hidden` (embedding -> layers -> last hidden states) is compiled once, over a
  symbolic token count T (tokens and positions marked dynamic, T >= 2: dynamo specialises 0
  and 1). Attention is one custom op per layer, opaque to the compiler
  (model/attention/op.py), which reads the step's spans and masks from the bound step, so
  nothing about the mix of prefills and decodes, the table widths or the KV pool's size is a
  shape or a guard of the graph: one graph for every step and every pool.
- On a GPU, inductor's graph partitioning cuts the graph at the attention op (tagged
  `cudagraph_unsafe`) and CUDA graphs capture the pieces between (vLLM's piecewise graphs),
  one recording per token count in `token_sizes` (2, 4, 8, then steps of 8 up to 512):
  a step of up to 512 tokens is padded to the next size; a larger one runs the same compiled
  code at its exact size, launched kernel by kernel (its matmuls leave little launch overhead
  to save). On the CPU no step is padded (only a 1-token step, to 2).
- The LM head and the final norm run eagerly on the sampled rows (`Transformer.logits`): their
  row count varies apart from T. Sampling is a small graph of its own over a symbolic row
  count, padded to `capture_sizes` rows, of logits the grammar mask was already applied to
  (engine/decode_mask.py); the top alternatives are always computed, so they are no guard;
  `greedy_only` and `filters` are (a greedy step, or one where no row asks for top-k, top-p or
  min-p, skips the sort over the vocabulary), so a job has at most three sampling graphs, all
  compiled at warm-up.
- Warm-up, after the KV pool is allocated and before the first row: the first call compiles
  (`compile_s`); on a GPU every token size and every sampling size then runs twice, a warm-up
  and a recording (`capture_s`). With a compile cache (engine/compile_cache.py) its
  artifacts are loaded first, inside the inductor folder the compile reads, and saved after.
- A graph that cannot be built after all (inductor failing to lower it, a branch that pins
  T, a graph break) does not end the job: one warning, and the steps run eagerly (the same
  code), as the stats' `compiled_token_share` then shows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from batchgen.engine.compile_cache import CompileCache, inductor_scope, local_inductor_dir
from batchgen.engine.sampler import SamplingColumns, SamplingTensors
from batchgen.engine.step_inputs import WarmUp, padded_batch
from batchgen.engine.step_sampling import sample_step

log = logging.getLogger(__name__)

# A graph that cannot be built: inductor failing to lower it (BackendCompilerFailed), the graph
# pinning the token count (ConstraintViolationError, dynamo's UserError; or a graph per count
# until dynamo's recompile limit, FailOnRecompileLimitHit under fullgraph), or code dynamo
# cannot trace in one graph (Unsupported: a graph break under fullgraph).
_COMPILE_FAILED = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.UserError,
    torch._dynamo.exc.FailOnRecompileLimitHit,
    torch._dynamo.exc.Unsupported,
    ConstraintViolationError,
)


# The compiled sampling's graphs: greedy; sampled; sampled with a row filtering (top-k/p,
# min-p).
SAMPLING_MODES = ("greedy", "sampled", "filtered")


def graph_counts() -> tuple[int, int]:
    """(graphs inductor compiled, graphs it loaded from its cache) in this process so far:
    torch's own counters, so a compile-cache hit means a compile avoided."""
    c = counters["inductor"]
    return c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"], c["fxgraph_cache_hit"]


def dynamo_graphs() -> int:
    """The graphs dynamo has built in this process so far (its own counter), less flex's
    kernels, compiled on their own inside the attention op (paged_flex counts them)."""
    return counters["stats"]["unique_graphs"] - counters["batchgen"]["flex_graphs"]


def _options(device: torch.device, sizes: list[int]) -> dict | None:
    """CUDA graphs on a GPU, recorded only at `sizes` of the symbolic axis (other sizes run
    without), and the graph partitioned at the attention op (torch 2.13's default, named)."""
    if device.type != "cuda":
        return None
    return {
        "triton.cudagraphs": True,
        "graph_partition": True,
        "triton.cudagraph_capture_sizes": tuple(sizes),
        "triton.cudagraph_dynamic_shape_warn_limit": None,
    }


def _sample(logits, temperature, top_k, top_p, seed, min_p, steps, ban, greedy_only, filters):
    sampling = SamplingTensors(temperature, top_k, top_p, seed, min_p, ban)
    return sample_step(logits, sampling, steps, greedy_only, True, filters)


class CompiledForward:
    def __init__(
        self, hidden: Callable, device: torch.device, cache: CompileCache | None = None
    ) -> None:
        """hidden: the model's (tokens, positions) -> hidden states (Transformer.hidden);
        cache: where its compiled artifacts are kept across processes (None: not kept)."""
        self.eager_hidden, self.device, self.cache = hidden, device, cache
        self.loaded = False  # the compile cache's artifacts were loaded (build)
        self.kernels: int | None = None  # C++ kernel files it restored (None: none kept)
        self.counts_at_build = (0, 0)  # graph_counts() when built
        self.token_sizes: list[int] = []  # CUDA graphs' token counts (none on the CPU)
        self.row_sizes: list[int] = [2]  # sampling's padded row counts
        self.hidden: Callable | None = None  # compiled at warm_up
        self.sampler: Callable | None = None
        self.failed = False  # the symbolic graph could not be built: eager from then on
        self.graphs = 0  # the forward's graphs dynamo built (1 in steady state, whatever T)
        self.sample_graphs = 0  # sampling's (SAMPLING_MODES: 3 at most)
        # inductor's own cache while this forward compiles (engine/compile_cache.py)
        self.inductor_dir = cache.inductor_dir() if cache is not None else local_inductor_dir()

    def build(self, token_sizes: list[int], row_sizes: list[int]) -> None:
        """The compiled callables (they compile at their first call), with CUDA graphs at
        these token and row counts; the compile cache's artifacts loaded first, into the
        inductor folder the compile reads."""
        self.counts_at_build = graph_counts()
        if self.cache is not None:
            with inductor_scope(self.inductor_dir):
                self.kernels = self.cache.restore_kernels()
                self.loaded = self.cache.load() == "loaded"
        self.token_sizes, self.row_sizes = token_sizes, row_sizes
        dev = self.device
        opts = _options(dev, token_sizes)
        self.hidden = torch.compile(self.eager_hidden, fullgraph=True, options=opts)
        self.sampler = torch.compile(_sample, fullgraph=True, options=_options(dev, row_sizes))

    def padded(self, t: int) -> int:
        """The token count a step of t tokens runs at: the next CUDA-graph size up to the
        cap, else t itself (at least 2: dynamo would specialise 1)."""
        for s in self.token_sizes:
            if s >= t:
                return s
        return max(t, 2)

    # ------------------------------------------------------------------ calls

    def run_hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) tokens and positions (T padded by `padded`) -> (T, dim), inside a bound step."""
        if self.failed or self.hidden is None:
            return self.eager_hidden(tokens, positions)
        for t in (tokens, positions):
            torch._dynamo.mark_dynamic(t, 0)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with inductor_scope(self.inductor_dir):  # a compile after the warm-up: none expected
            before = dynamo_graphs()
            try:
                return self.hidden(tokens, positions)
            except _COMPILE_FAILED as e:
                self._fail(e)
            finally:
                self.graphs += dynamo_graphs() - before
        return self.eager_hidden(tokens, positions)

    def sample(self, logits: torch.Tensor, sampling: SamplingColumns) -> tuple[torch.Tensor, ...]:
        """(tokens, logprobs, top logprobs, their ids) of the n rows of logits (n, V) and
        more: the rows padded to a capture size on a GPU (its CUDA graphs'), to 2 at least on
        the CPU (dynamo would specialise 1)."""
        n = logits.shape[0]
        b = padded_batch(n) if self.device.type == "cuda" else max(n, 2)
        if b > n:
            logits = torch.cat([logits, logits.new_zeros(b - n, logits.shape[1])])
            sampling.pad(b - n)
        samp, steps = sampling.tensors(self.device, graph=True)
        s = samp
        args = (logits, s.temperature, s.top_k, s.top_p, s.seed, s.min_p, steps, s.ban)
        mode = (sampling.greedy_only, not sampling.greedy_only and sampling.filters)
        if self.failed or self.sampler is None:
            return _sample(*args, *mode)
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
        with inductor_scope(self.inductor_dir):
            before = dynamo_graphs()
            try:
                return self.sampler(*args, *mode)
            except _COMPILE_FAILED as e:
                self._fail(e)
            finally:
                self.sample_graphs += dynamo_graphs() - before
        return _sample(*args, *mode)

    def _fail(self, e: Exception) -> None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning(
            "the forward could not be compiled as one graph over a symbolic token count (%s): "
            "the steps run eagerly instead",
            first[:200],
        )
        self.failed = True

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, run: Callable[[int | None, str], None], max_rows: int) -> WarmUp:
        """run(tokens, mode): one step of that many tokens through the whole path (the
        runner's: broadcast, forward, sampling in mode, one of SAMPLING_MODES; None: the
        largest prefill). Compile with the first, then (CUDA) warm up and record every size."""
        warm = WarmUp()
        t0 = time.perf_counter()
        before = graph_counts()
        with inductor_scope(self.inductor_dir):
            run(None, "greedy")  # the largest prefill (the warm-up's peak): the compile
            for mode in SAMPLING_MODES[1:]:  # the largest decode: sampling's other graphs
                run(max_rows, mode)
            _sync(self.device)
            t1 = time.perf_counter()
            if self.device.type == "cuda":
                for t in sorted(set(self.token_sizes) | set(self.row_sizes)):
                    for mode in SAMPLING_MODES:
                        for _ in range(2):  # cudagraph trees: a warm-up run, then the recording
                            run(t, mode)
            _sync(self.device)
        warm.compile_seconds, warm.capture_seconds = t1 - t0, time.perf_counter() - t1
        after = graph_counts()
        warm.graphs_compiled = after[0] - before[0]
        warm.graphs_loaded = after[1] - before[1]
        if self.cache is not None:  # a hit: every graph loaded, none compiled
            hit = self.loaded and warm.graphs_loaded and not warm.graphs_compiled
            warm.cache = "hit" if hit else "miss"
            self.save()
        return warm

    def save(self) -> None:
        """Keep this process's artifacts in the compile cache if it compiled a graph since
        `build` (the cache's file, if any, did not serve it: it is replaced), and the C++
        kernels then too, or when none were kept (an entry from before they were)."""
        if self.cache is None:
            return
        compiled = graph_counts()[0] > self.counts_at_build[0]
        if compiled:
            self.cache.save()
            self.counts_at_build = graph_counts()
        if compiled or self.kernels is None:  # kept now, or nothing to keep (a GPU's)
            self.cache.save_kernels()
            self.kernels = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
