"""The model runner: the one place a step plan (plain Python) becomes tensors. It packs the
plan (step_inputs.py), runs the model on the paged cache, samples, and hands back one
(token, logprob) per sampling sequence.

Decode attention has one path per device (`decode_backend`): on CUDA, FlexAttention reads
each row's blocks in place from the paged pool; on the CPU, the rows' blocks are gathered and
SDPA runs over the copy (measured faster there; docs/architecture.md).

Eagerly, a step runs at its exact size: no padding rows, no padding tokens. Compiled
(`compile=True`), decode-only steps, the steady state, run through engine/compiled_decode.py:
the forward compiled once over a symbolic batch, sampling a small graph of its own, CUDA
graphs on a GPU for each capture size (2, 4, then steps of 8 up to max_num_seqs), all warmed
up before the first request (`warm_up`). Steps with prefill chunks run eagerly: their
per-sequence attention has data-dependent shapes, and their large matmuls leave little launch
overhead to save.

With tensor parallelism, rank 0's runner hands each step's `StepInputs` to `broadcast` (the
other ranks' runners run `forward` on them) before running its own part; only rank 0
samples. The host reads each step's sampled tokens (one small copy): the scheduler needs them
to plan the next step. A scored candidate's chunk (the score task) adds its scored positions
to the LM head's rows: the log-probability of each next token, nothing sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.engine.penalties import TokenCounts, apply_penalties
from batchgen.engine.sampler import SamplingColumns
from batchgen.engine.scored_logprobs import score_rows
from batchgen.engine.sequence import ScoredChunk, StepPlan
from batchgen.engine.step_inputs import (
    StepInputs,
    WarmUp,
    capture_sizes,
    pack_decode,
    pack_step,
    warmup_eager,
)
from batchgen.engine.step_sampling import Sampled, sample_step, to_host, wants_top
from batchgen.model.attention import (
    DecodeBackend,
    DecodeGroup,
    PrefillSpan,
    StepAttention,
    decode_backend,
)
from batchgen.model.tp_layers import CollectiveClock
from batchgen.model.transformer import Transformer

if TYPE_CHECKING:
    from batchgen.engine.compile_cache import CompileCache
    from batchgen.engine.compiled_decode import CompiledDecode


@dataclass(slots=True)
class StepTiming:
    seconds: float = 0.0  # the step, compile excluded
    compile_seconds: float = 0.0  # first call of a new compiled shape (compile + first run)
    padded_rows: int = 0  # decode rows computed only to fill a compiled shape
    new_shape: bool = False  # a compiled shape's first call
    collective_seconds: float = 0.0  # of seconds, in tensor-parallel collectives (where timed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        *,
        block_size: int,
        compile: bool = False,
        broadcast: Callable[[StepInputs], None] | None = None,
        clock: CollectiveClock | None = None,
        compile_cache: CompileCache | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """broadcast: rank 0 of a tensor-parallel group hands it each step's inputs; clock:
        where the model's collectives add up their time; compile_cache: where compiled graphs
        are kept across processes (with compile)."""
        self.model = model
        self.device = model.embed.weight.device
        self.block_size = block_size
        self.num_blocks = 0  # no cache until allocate()
        self.max_positions = model.cfg.max_position_embeddings
        self.rope_rows = model.cfg.long_rope  # a longrope model's: positions -> table rows
        self.compiled = compile
        self.attention = decode_backend(self.device, block_size, model.cfg.head_dim)
        self.broadcast, self.clock = broadcast, clock
        self.shapes: set[tuple[int, bool]] = set()  # (padded batch, greedy-only) decodes run
        self.decode: CompiledDecode | None = None
        # the logits' width: the whole model's (a tensor-parallel rank's cfg has its share)
        self.vocab_size = vocab_size or model.cfg.vocab_size
        self.counts = TokenCounts(self.vocab_size, self.device)  # no memory until used
        if compile:
            # imported here: torch._dynamo takes ~1 s to import, a tenth of a small eager job
            from batchgen.engine.compiled_decode import CompiledDecode

            self.decode = CompiledDecode(model, self.attention, block_size, compile_cache)

    def allocate(self, num_blocks: int) -> None:
        """Allocate the paged cache once: num_blocks blocks per layer, block 0 scratch.
        (Compiled graphs hold its buffers, so it is never reallocated.)"""
        if self.num_blocks:
            raise RuntimeError("the KV cache is already allocated")
        self.model.setup_caches(num_blocks, self.block_size)
        self.num_blocks = num_blocks
        if self.decode is not None:  # the graph takes any pool: a compile cache serves all
            for cache in self.model.kv_caches:
                torch._dynamo.maybe_mark_dynamic(cache.k, 0)
                torch._dynamo.maybe_mark_dynamic(cache.v, 0)

    def free_device_bytes(self) -> int | None:
        """Free accelerator memory (None on the CPU, where the pool is sized from the job)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free

    # Processes on this host that hold a pool like this one: the tensor-parallel ranks on the
    # CPU share its memory (RankedRunner sets it), so a pool sized from the job is checked x it.
    host_ranks: int = 1

    def max_pool_blocks(self) -> int | None:
        """The most blocks the pool may hold for this runner's attention. FlexAttention reads
        each layer's pool as one sequence, and once a layer's K holds 2**31 elements or more,
        inductor indexes the CUDA decoding kernel in int64, which its template fails to
        compile ("Ternary expression with dynamic condition has inconsistent types int64 and
        int32": torch 2.11 on an H200, where a tiny model's pool from 80% of free memory held
        219M tokens). Real models stay far below (Llama 3 8B: 0.8M tokens in 100 GB); small
        ones on large GPUs are capped here. None: no bound (the gather path)."""
        if self.attention is not DecodeBackend.FLEX:
            return None
        cfg = self.model.cfg
        return (2**31 - 1) // (self.block_size * cfg.n_kv_heads * cfg.head_dim)

    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block on this rank (its KV heads)."""
        cfg = self.model.cfg
        return cfg.kv_bytes_per_token(self.model.embed.weight.element_size()) * self.block_size

    def warm_up(self, max_num_seqs: int, max_tokens: int) -> WarmUp:
        """After allocate() and before the first request: run a full-size prefill and (eager)
        a decode of max_num_seqs rows once (step_inputs.warmup_eager), and compile (and on a
        GPU capture) the decode graphs for every batch of up to max_num_seqs rows."""
        t0 = time.perf_counter()
        steps = warmup_eager(
            max_tokens, max_num_seqs, self.block_size, self.model.cfg.max_position_embeddings
        )
        for x in steps if self.decode is None else steps[:1]:  # compiled: its own decode
            if self.broadcast is not None:
                self.broadcast(x)
            self.forward(x)
        _sync(self.device)
        eager = time.perf_counter() - t0
        if self.decode is None:
            return WarmUp(warmup_seconds=eager)
        warm = self.decode.warm_up(capture_sizes(max_num_seqs), self.broadcast)
        warm.warmup_seconds = eager
        return warm

    # ------------------------------------------------------------------ step

    def forward(self, x: StepInputs) -> torch.Tensor:
        """The float32 logits (len(x.logits_index), vocab) of one step's inputs (what a
        tensor-parallel rank other than 0 runs)."""
        if x.compiled:
            logits = self.decode.logits(x)
            if x.save_compile_cache and self.decode.cache is not None:
                self.decode.cache.save()
            return logits
        dev = self.device
        step = StepAttention(
            backend=self.attention,
            slots=torch.tensor(x.slots, device=dev),
            num_decodes=sum(len(lens) for _, _, lens in x.decodes),
            decodes=tuple(
                DecodeGroup(q, torch.tensor(t, device=dev), torch.tensor(n, device=dev))
                for q, t, n in x.decodes
            ),
            prefills=tuple(
                PrefillSpan(q, n, c, None if b is None else torch.tensor(b, device=dev))
                for q, n, c, b in x.prefills
            ),
        )
        tokens, positions = (torch.tensor(v, device=dev) for v in (x.tokens, x.positions))
        return self.model(tokens, positions, step, torch.tensor(x.logits_index, device=dev))

    def execute(
        self, plan: StepPlan, bitmask: torch.Tensor | None = None
    ) -> tuple[Sampled, list[ScoredChunk], StepTiming]:
        """Run one step; returns (token, logprob) per sampling sequence in plan order, and
        the scored tokens' log-probabilities per scored candidate's chunk in plan order.
        bitmask: (sampling sequences, words) allowed-token masks in plan order, or None."""
        before = self.clock.seconds if self.clock is not None else 0.0
        if self.compiled and not plan.prefills:
            sampled, scored, timing = self._execute_compiled_decode(plan, bitmask)
        else:
            sampled, scored, timing = self._execute_eager(plan, bitmask)
        if self.clock is not None:
            timing.collective_seconds = self.clock.seconds - before
        return sampled, scored, timing

    def _execute_eager(
        self, plan: StepPlan, bitmask: torch.Tensor | None
    ) -> tuple[Sampled, list[ScoredChunk], StepTiming]:
        # Flex reads every row's blocks in place: one group; the gather pads each group's
        # copy to its longest table, so it groups rows by width.
        groups = 1 if self.attention is DecodeBackend.FLEX else 4
        packed = pack_step(plan, self.block_size, max_groups=groups, rope=self.rope_rows)
        dev, n = self.device, len(packed.sampled)
        t0 = time.perf_counter()
        if self.broadcast is not None:
            self.broadcast(packed.inputs)
        logits = self.forward(packed.inputs)
        # the scored positions' rows follow the sampled ones (scored_logprobs.py)
        per_chunk = score_rows(logits[n:], packed.targets, packed.scored, plan)
        if not n:  # prefill chunks that sample nothing
            _sync(dev)
            return [], per_chunk, StepTiming(time.perf_counter() - t0)
        sampling = SamplingColumns()
        for s in packed.sampled:
            sampling.add(s)
        samp, steps = sampling.tensors(dev)
        apply_penalties(logits[:n], packed.sampled, self.counts)
        nd = len(packed.decode_order)
        if bitmask is not None:  # to the packed order: decodes by width, then prefills
            bitmask = bitmask[torch.tensor(packed.decode_order + list(range(nd, n)), device=dev)]
        top = wants_top(packed.sampled)
        out = to_host(
            sample_step(logits[:n], samp, steps, sampling.greedy_only, bitmask, top),
            packed.sampled,
            top,
        )
        decoded = [None] * nd  # back to plan order
        for j, i in enumerate(packed.decode_order):
            decoded[i] = out[j]
        return decoded + out[nd:], per_chunk, StepTiming(time.perf_counter() - t0)

    def _execute_compiled_decode(
        self, plan: StepPlan, bitmask: torch.Tensor | None
    ) -> tuple[Sampled, list[ScoredChunk], StepTiming]:
        packed = pack_decode(plan, self.block_size, rope=self.rope_rows)
        x, n, pad = packed.inputs, len(plan.decodes), packed.padded_rows
        sampling = SamplingColumns()
        for s in packed.sampled:
            sampling.add(s)
        sampling.pad(pad)
        key = (len(x.tokens), sampling.greedy_only)
        graphs = self.decode.graphs + self.decode.sample_graph.graphs
        t0 = time.perf_counter()
        if self.broadcast is not None:
            self.broadcast(x)
        logits = apply_penalties(self.decode.logits(x), packed.sampled[:n], self.counts)
        result = self.decode.sample(logits, sampling, bitmask)
        out = to_host(result, packed.sampled[:n], wants_top(packed.sampled))  # the one sync
        dt = time.perf_counter() - t0
        self.shapes.add(key)
        if self.decode.graphs + self.decode.sample_graph.graphs > graphs:  # a compile: after
            return out, [], StepTiming(0.0, dt, pad, new_shape=True)  # warm-up, not expected
        return out, [], StepTiming(dt, 0.0, pad)
