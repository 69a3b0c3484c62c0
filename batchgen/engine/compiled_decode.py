"""The compiled decode: the model's forward as one graph, sampling as a small one, warmed up
before the first request.

- The forward (`_logits`) is compiled once, over a symbolic batch (engine/compiled_step.py);
  the attention of each layer is one opaque custom op (model/decode_ops.py). Its inputs are
  the step's tokens, positions and slots, then the attention's: the block tables and lengths
  (gather) or a PagedMask's tensors (flex), built outside the graph once a step.
- Sampling (`_sample`) is a graph of its own: a grammar bitmask is always given (all ones
  when no row is constrained) and the top alternatives always computed (read back only when a
  row asks), so neither is a guard. `greedy_only` stays one: a greedy-only step skips the sort
  over the vocabulary, so a job has at most two sampling graphs, a few kernels each.
- Warm-up (`warm_up`), right after the KV pool is allocated: the first capture size compiles
  both graphs (`compile_s`), then on a GPU each capture size is run twice, once to warm up and
  once to record its CUDA graphs (`capture_s`; flex's kernel also compiles here at each new
  power-of-two row count). Rows enter the queue after it, so no row's TTFT holds it. With a
  compile cache (engine/compile_cache.py) the artifacts are loaded first and saved after.

vLLM does the same in its own way: compile over a symbolic token count, attention in
`splitting_ops`, CUDA graphs captured for a fixed list of sizes at start-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from batchgen.engine.compile_cache import CompileCache, inductor_scope, local_inductor_dir
from batchgen.engine.compiled_step import CompiledStep
from batchgen.engine.sampler import SamplingColumns, SamplingTensors
from batchgen.engine.step_inputs import StepInputs, WarmUp, warmup_decode
from batchgen.engine.step_sampling import sample_step
from batchgen.model.attention import DecodeBackend, DecodeGroup, StepAttention
from batchgen.model.paged_flex import PagedMask
from batchgen.model.transformer import Transformer

# The forward's inputs and the axes that vary: tokens, positions, slots (B,); then gather:
# tables (B, W), lens (B,); flex: num (R,), indices (R, W), logical (pool + 1,), tables (R, W),
# lens (R,), with W fixed for the model (paged_flex.list_width).
_STEP_DIMS = ((0,), (0,), (0,))
_GATHER_DIMS = ((0, 1), (0,))
_FLEX_DIMS = ((0,), (0,), (0,), (0,), (0,))
# Sampling's: logits (B, V), temperature, top_k, top_p, seed, min_p, steps (B,), ban (B, W),
# bitmask (B, words), greedy_only (a guard).
_SAMPLE_DIMS = ((0,),) * 9 + (None,)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CompiledDecode:
    def __init__(
        self,
        model: Transformer,
        attention: DecodeBackend,
        block_size: int,
        cache: CompileCache | None = None,
    ) -> None:
        self.model, self.attention, self.block_size, self.cache = (
            model,
            attention,
            block_size,
            cache,
        )
        self.device = model.embed.weight.device
        flex = attention is DecodeBackend.FLEX
        dims = _STEP_DIMS + (_FLEX_DIMS if flex else _GATHER_DIMS)
        self.forward_graph = CompiledStep(self._logits, self.device, dims)
        self.sample_graph = CompiledStep(self._sample, self.device, _SAMPLE_DIMS)
        self.words = -(-model.cfg.vocab_size // 32)  # a grammar bitmask's int32 words a row
        # inductor's own cache while this engine compiles (engine/compile_cache.py)
        self.inductor_dir = (
            cache.inductor_dir(self.device) if cache is not None else local_inductor_dir()
        )
        import torch._inductor.compile_fx  # noqa: F401  (start-up, ~1 s: not compile_s)

    @property
    def graphs(self) -> int:
        """The model's compiled graphs so far (1 in steady state; sampling's not counted)."""
        return self.forward_graph.graphs

    # ------------------------------------------------------------------ graphs

    def _logits(self, tokens, positions, slots, *attn) -> torch.Tensor:
        """(B,) tokens at (B,) positions -> (B, vocab) float32 logits."""
        b = tokens.shape[0]
        if self.attention is DecodeBackend.FLEX:
            mask = PagedMask(*attn)
            group = DecodeGroup(0, None, mask.lens, mask)
        else:
            tables, lens = attn
            group = DecodeGroup(0, tables, lens)
        step = StepAttention(slots, b, (group,), backend=self.attention)
        return self.model(tokens, positions, step, torch.arange(b, device=tokens.device))

    @staticmethod
    def _sample(
        logits, temperature, top_k, top_p, seed, min_p, steps, ban, bitmask, greedy_only: bool
    ):
        sampling = SamplingTensors(temperature, top_k, top_p, seed, min_p, ban)
        return sample_step(logits, sampling, steps, greedy_only, bitmask, top=True)

    # ------------------------------------------------------------------ a step

    def tensors(self, x: StepInputs) -> tuple[torch.Tensor, ...]:
        """The forward's inputs for a padded decode step (pack_decode's)."""
        dev = self.device
        tokens, positions, slots = (
            torch.tensor(v, device=dev) for v in (x.tokens, x.positions, x.slots)
        )
        _, tables_list, lens_list = x.decodes[0]
        tables, lens = (torch.tensor(v, device=dev) for v in (tables_list, lens_list))
        if self.attention is DecodeBackend.GATHER:
            return tokens, positions, slots, tables, lens
        group = DecodeGroup(0, tables, lens)
        step = StepAttention(slots, len(x.tokens), (group,), backend=self.attention)
        mask = self.model.step_masks(step).decodes[0].mask  # padded to a power of two rows
        return (tokens, positions, slots, *mask.tensors())

    def logits(self, x: StepInputs) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with inductor_scope(self.inductor_dir):  # a compile after the warm-up: none expected
            return self.forward_graph(*self.tensors(x))

    def sample(
        self, logits: torch.Tensor, sampling: SamplingColumns, bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """(tokens, logprobs, top logprobs, their ids) of a padded step's rows."""
        samp, steps = sampling.tensors(self.device, graph=True)
        b = logits.shape[0]
        if bitmask is None:  # every token allowed
            bitmask = torch.full((b, self.words), -1, dtype=torch.int32, device=self.device)
        elif bitmask.shape[0] < b:  # padding rows allow every token
            bitmask = torch.cat([bitmask, bitmask.new_full((b - bitmask.shape[0], self.words), -1)])
        s = samp
        with inductor_scope(self.inductor_dir):
            return self.sample_graph(
                logits,
                *(s.temperature, s.top_k, s.top_p, s.seed, s.min_p, steps, s.ban, bitmask),
                sampling.greedy_only,
            )

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, sizes: list[int], broadcast: Callable[[StepInputs], None] | None) -> WarmUp:
        """Compile at the first capture size, then (CUDA) warm up and record every size, each
        greedy and sampled. broadcast: hands each warm-up step to the other TP ranks."""
        warm = WarmUp()
        t0 = time.perf_counter()
        if self.cache is not None:
            warm.cache = "hit" if self.cache.load() else "miss"
        with inductor_scope(self.inductor_dir):
            for greedy in (True, False):
                self._warm_step(sizes[0], greedy, broadcast)
            _sync(self.device)
            t1 = time.perf_counter()
            if self.device.type == "cuda":
                for b in sizes:
                    for greedy in (True, False):
                        for _ in range(2):  # cudagraph trees: a warm-up run, then the recording
                            self._warm_step(b, greedy, broadcast)
            _sync(self.device)
        warm.compile_seconds, warm.capture_seconds = t1 - t0, time.perf_counter() - t1
        if self.cache is not None and warm.cache == "miss":
            self.cache.save()
        if broadcast is not None:  # the other ranks save theirs (where they keep a cache)
            x = warmup_decode(sizes[0], self.block_size)
            x.save_compile_cache = True
            self._warm_step(sizes[0], True, broadcast, x)
        return warm

    def _warm_step(
        self,
        rows: int,
        greedy: bool,
        broadcast: Callable[[StepInputs], None] | None,
        x: StepInputs | None = None,
    ) -> None:
        x = x or warmup_decode(rows, self.block_size)
        if broadcast is not None:
            broadcast(x)
        sampling = SamplingColumns()
        sampling.pad(rows)
        if not greedy:
            sampling.temperature[:] = [1.0] * rows
        self.sample(self.logits(x), sampling, None)
