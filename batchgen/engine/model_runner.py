"""The model runner: the one place a step plan (plain Python) becomes tensors. It packs the
plan (step_inputs.py), runs the model on the paged cache, samples, and hands back one
(token, logprob) per sampling sequence.

Decode attention has one path per device (`decode_backend`): on CUDA, FlexAttention reads
each row's blocks in place from the paged pool; on the CPU, the rows' blocks are gathered and
SDPA runs over the copy (measured faster there; docs/architecture.md).

A step runs at its exact size: no padding rows, no padding tokens. Compiled (`compile=True`),
every step, prefill chunks and decodes alike, runs through engine/compiled_forward.py: the
model's forward compiled once over a symbolic token count, its attention an opaque op, the
pieces between captured as CUDA graphs on a GPU at a bounded set of token counts (to which a
step of up to 512 tokens is padded), sampling a small graph of its own; all compiled (and
recorded) in the warm-up, before the first request (`warm_up`). The LM head runs eagerly on
the sampled rows.

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

from batchgen.engine.block_pool import NULL_BLOCK
from batchgen.engine.block_table import BlockTables
from batchgen.engine.input_buffer import InputBuffer
from batchgen.engine.penalties import TokenCounts, apply_penalties
from batchgen.engine.pooling import PooledStep, pooled_step
from batchgen.engine.scored_logprobs import score_rows, scored_after, split_head
from batchgen.engine.sequence import ScoredChunk, SeqState, StepPlan
from batchgen.engine.step_inputs import StepInputs, WarmUp, pack_step
from batchgen.engine.step_sampling import Sampled, sample_rows, to_host, wants_top
from batchgen.engine.warmup import rewarm_attention, warm_up
from batchgen.model.attention.op import bound
from batchgen.model.attention.step import (
    DecodeBackend,
    DecodeGroup,
    PrefillSpan,
    StepAttention,
    decode_backend,
)
from batchgen.model.families.transformer import Transformer
from batchgen.model.parallel.collectives import CollectiveClock

if TYPE_CHECKING:
    from batchgen.engine.compile_cache import CompileCache
    from batchgen.engine.compiled_forward import CompiledForward
    from batchgen.engine.decode_mask import DecodeMask


@dataclass(slots=True)
class StepTiming:
    seconds: float = 0.0  # the step, compile excluded
    compile_seconds: float = 0.0  # first call of a new compiled shape (compile + first run)
    padded_rows: int = 0  # tokens computed only to fill a compiled shape (CUDA graphs)
    new_shape: bool = False  # a compile during the step (none expected after the warm-up)
    compiled: bool = False  # the forward ran the compiled graph
    collective_seconds: float = 0.0  # of seconds, in tensor-parallel collectives (where timed)
    # from the end of the last step (its results read) to this step's launch: the host's
    # time between device steps, which a GPU spends idle (None: the first step)
    host_gap_seconds: float | None = None


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
        # one rank of a native model: the head runs on scored rows a slice at a time (no
        # all-gather in it to keep in step with other ranks; scored_logprobs.py)
        self.head_slices = broadcast is None and isinstance(model, Transformer)
        self.shapes: set[int] = set()  # the token counts compiled steps ran at
        self.graph: CompiledForward | None = None
        # the logits' width: the whole model's (a tensor-parallel rank's cfg has its share)
        self.vocab_size = vocab_size or model.cfg.vocab_size
        self.counts = TokenCounts(self.vocab_size, self.device)  # no memory until used
        self.tables = BlockTables()  # the running sequences' block tables, kept (block_table.py)
        self.inputs = InputBuffer(self.device)  # a step's inputs in one copy (input_buffer.py)
        self.last_step_end: float | None = None  # perf_counter when the last step's results came
        # The transformers backend (model/hf/backend.py) has no `hidden`: it runs eagerly.
        if compile and isinstance(model, Transformer):
            # imported here: torch._dynamo takes ~1 s to import, a tenth of a small eager job
            from batchgen.engine.compiled_forward import CompiledForward

            self.graph = CompiledForward(model.hidden, self.device, compile_cache)
        elif compile:  # the transformers backend: it says so once, and runs eagerly
            from batchgen.model.hf.backend import warn_compile_eager

            warn_compile_eager()

    def allocate(self, num_blocks: int) -> None:
        """Allocate the paged cache: num_blocks blocks per layer, block 0 scratch. Again, it
        replaces the pool (the warm-up's small one, engine.py): no graph holds it, the attention
        op reads it from the bound step."""
        if self.num_blocks:
            for cache in self.model.kv_caches:  # the old pool freed before the new one
                cache.k = cache.v = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.model.setup_caches(num_blocks, self.block_size)
        self.num_blocks = num_blocks

    @property
    def measures_memory(self) -> bool:
        """Is the pool sized from the memory left after the warm-up (a GPU's), not the job?"""
        return self.device.type == "cuda"

    def kv_budget_bytes(self, utilization: float) -> int:
        """After the warm-up, the bytes the KV pool may take, vLLM's rule: utilization x the
        device's total memory, less what is in use now (weights, CUDA graphs' pools, the CUDA
        context, other processes') and the warm-up's transient peak above what it kept."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        transient = peak - torch.cuda.memory_allocated(self.device)
        return int(total * utilization) - (total - free) - transient

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
        """After allocate() and before the first request (engine/warmup.py)."""
        return warm_up(self, max_num_seqs, max_tokens)

    def rewarm_attention(self, max_num_seqs: int) -> None:
        """After the pool was replaced (engine/warmup.py)."""
        rewarm_attention(self, max_num_seqs)

    def run_warm(self, x: StepInputs) -> torch.Tensor:
        """A warm-up step: padded, sent to the other ranks, run."""
        self._pad(x)
        if self.broadcast is not None:
            self.broadcast(x)
        return self.forward(x)

    def build_graph(self, token_sizes: list[int], row_sizes: list[int]) -> None:
        """Compile (at the next call) with CUDA graphs at these token and sampling row counts,
        after loading the compile cache's artifacts (tensor parallel: on every rank)."""
        self.graph.build(token_sizes, row_sizes)

    def _pad(self, x: StepInputs) -> None:
        """x's tokens padded to the compiled graph's size for them (before it reaches the
        other ranks, so every rank runs the same count): token 0 at position 0 into the
        scratch block."""
        if self.graph is not None:
            x.pad(self.graph.padded(len(x.tokens)), NULL_BLOCK * self.block_size)

    def release(self, seqs: list[SeqState]) -> None:
        """Finished sequences' block-table rows back (block_table.py)."""
        for seq in seqs:
            self.tables.release(seq)

    # ------------------------------------------------------------------ step

    def forward(
        self, x: StepInputs, pool: PooledStep | None = None, split: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """A step's float32 logits (len(x.logits_index), vocab), what other tensor-parallel ranks
        run; with split its hidden states and index, the head left to the caller. pool: the
        step's pooled rows, which take the hidden states (None: only pooled rows ran)."""
        d = self.inputs.upload(x)  # the step's one host -> device copy
        step = StepAttention(
            backend=self.attention,
            flex_compiled=self.graph is not None,
            slots=d.slots,
            num_decodes=sum(len(lens) for _, _, lens in x.decodes),
            decodes=tuple(DecodeGroup(q, t, n) for q, t, n in d.decodes),
            prefills=tuple(PrefillSpan(q, n, c, b) for q, n, c, b in d.prefills),
        )
        tokens, positions, index = d.tokens, d.positions, d.logits_index
        if self.graph is None and pool is None and not split:  # eager: bind, hidden, logits
            return self.model(tokens, positions, step, index)
        if self.graph is not None:
            self.shapes.add(len(x.tokens))
        with bound(self.model.bind(step)):
            run = self.model.hidden if self.graph is None else self.graph.run_hidden
            h = run(tokens, positions)
        if pool is not None:  # engine/pooling.py
            pool.take(h)
            if pool.only:
                return None
        if x.save_compile_cache:
            self.graph.save()
        return (h, index) if split else self.model.logits(h, index)

    def execute(
        self, plan: StepPlan, mask: DecodeMask | None = None
    ) -> tuple[Sampled, list[ScoredChunk], StepTiming]:
        """Run one step; returns (token, logprob) per sampling sequence in plan order, and
        the scored tokens' log-probabilities per scored candidate's chunk in plan order.
        mask: what masks the constrained rows' logits (engine/decode_mask.py), or None."""
        before = self.clock.seconds if self.clock is not None else 0.0
        graphs = self.graph.graphs + self.graph.sample_graphs if self.graph else 0
        sampled, scored, timing = self._execute(plan, mask)
        if self.graph is not None:
            timing.compiled = not self.graph.failed
            t = sum(s.num_tokens for s in plan.scheduled)
            timing.padded_rows = self.graph.padded(t) - t
            if self.graph.graphs + self.graph.sample_graphs > graphs:  # none after the warm-up
                timing.new_shape = True
                timing.compile_seconds, timing.seconds = timing.seconds, 0.0
        if self.clock is not None:
            timing.collective_seconds = self.clock.seconds - before
        return sampled, scored, timing

    def _execute(
        self, plan: StepPlan, mask: DecodeMask | None
    ) -> tuple[Sampled, list[ScoredChunk], StepTiming]:
        # Flex reads every row's blocks in place: one group; the gather pads each group's
        # copy to its longest table, so it groups rows by width.
        groups = 1 if self.attention is DecodeBackend.FLEX else 4
        rope = self.rope_rows
        packed = pack_step(plan, self.tables, self.block_size, max_groups=groups, rope=rope)
        dev, n = self.device, len(packed.sampled)
        self._pad(packed.inputs)
        t0 = time.perf_counter()
        gap = None if self.last_step_end is None else t0 - self.last_step_end
        if self.broadcast is not None:
            self.broadcast(packed.inputs)
        # tensor parallel: the other ranks run the LM head's all-gather, so rank 0 runs it too
        pool = pooled_step(self.model, plan, packed.inputs.prefills, self.broadcast is None)
        split = bool(packed.targets) and self.head_slices
        out = self.forward(packed.inputs, pool, split)
        if out is None:  # pooled rows only: no scored token, nothing sampled
            logits, per_chunk = None, [ScoredChunk([]) for _ in packed.scored]
        else:  # the scored positions' rows follow the sampled ones (scored_logprobs.py)
            logits, scored = split_head(self.model, *out, n) if split else scored_after(out, n)
            per_chunk = score_rows(scored, packed.targets, packed.scored, plan)
        if logits is None or not n:  # prefill chunks that sample nothing
            _sync(dev)
            return [], per_chunk, self._timing(t0, gap)
        apply_penalties(logits[:n], packed.sampled, self.counts)
        if mask is not None:  # constrained rows: tokens outside their grammar get -inf
            mask.apply(logits[:n], [s.seq for s in packed.sampled])
        nd = len(packed.decode_order)
        top = wants_top(packed.sampled)
        compiled = self.graph.sample if self.graph is not None else None
        result = sample_rows(logits[:n], packed.sampled, top, compiled)
        out = to_host(result, packed.sampled, top)  # the step's one host read
        decoded = [None] * nd  # back to plan order
        for j, i in enumerate(packed.decode_order):
            decoded[i] = out[j]
        return decoded + out[nd:], per_chunk, self._timing(t0, gap)

    def _timing(self, t0: float, gap: float | None) -> StepTiming:
        self.last_step_end = time.perf_counter()
        return StepTiming(self.last_step_end - t0, host_gap_seconds=gap)
