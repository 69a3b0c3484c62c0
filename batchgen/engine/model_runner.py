"""The model runner: turns a step plan (plain Python) into tensors, runs the model on the
paged cache, samples, and hands back one (token, logprob) per sampling sequence.

A step's tokens are packed flat, decodes first, then prefill chunks; each token carries
its position and its cache slot (block_table[pos // block_size] * block_size + pos %
block_size). Eagerly, the step runs at its exact size: no padding rows, no padding tokens.

Compiled (`compile=True`), decode-only steps, the steady state, run through one
torch.compile'd graph per shape, CUDA graphs on a GPU: the batch is padded up to a power of
two and the block tables to a power-of-two width, so a job sees a bounded set of shapes
(log2(max_num_seqs) + 1 batch sizes times a few context buckets). Padding rows decode
token 0 at position 0 into the scratch block. Steps with prefill chunks run eagerly: their
per-sequence attention has data-dependent shapes, and their large matmuls leave little
launch overhead to save.

The host reads each step's sampled tokens (one small copy): the scheduler needs them to
plan the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from batchgen.engine.block_pool import NULL_BLOCK
from batchgen.engine.constraints import apply_bitmask
from batchgen.engine.sampler import SamplingTensors, sample
from batchgen.engine.scheduler import Scheduled, StepPlan
from batchgen.model.attention import DecodeGroup, PrefillSpan, StepAttention
from batchgen.model.transformer import Transformer


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _width_groups(widths: list[int], max_groups: int = 4, keep: float = 0.6) -> list[tuple[int, int]]:  # fmt: skip
    """Cut widths (sorted descending) into at most max_groups ranges [lo, hi): a new group
    starts where a width falls below keep x its group's first, so padding stays small."""
    groups, lo = [], 0
    for i, w in enumerate(widths):
        if i > lo and w < keep * widths[lo] and len(groups) < max_groups - 1:
            groups.append((lo, i))
            lo = i
    return [*groups, (lo, len(widths))] if widths else []


@dataclass(slots=True)
class StepTiming:
    seconds: float = 0.0  # the step, compile excluded
    compile_seconds: float = 0.0  # first call of a new compiled shape (compile + first run)
    padded_rows: int = 0  # decode rows computed only to fill a compiled shape


@dataclass(slots=True)
class _Sampling:
    """Host-side columns of the sampling rows of a step."""

    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    seed: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # tokens the row generated so far

    def add(self, s: Scheduled) -> None:
        p = s.seq.params
        self.temperature.append(p.temperature)
        self.top_k.append(p.top_k)
        self.top_p.append(p.top_p)
        self.seed.append(p.seed)
        self.steps.append(s.seq.num_generated)

    def pad(self, n: int) -> None:
        for col, fill in (
            (self.temperature, 0.0),
            (self.top_k, 0),
            (self.top_p, 1.0),
            (self.seed, 0),
            (self.steps, 0),
        ):
            col.extend([fill] * n)

    def tensors(self, dev: torch.device) -> tuple[SamplingTensors, torch.Tensor]:
        return SamplingTensors(
            temperature=torch.tensor(self.temperature, dtype=torch.float32, device=dev),
            top_k=torch.tensor(self.top_k, dtype=torch.long, device=dev),
            top_p=torch.tensor(self.top_p, dtype=torch.float32, device=dev),
            seed=torch.tensor(self.seed, dtype=torch.long, device=dev),
        ), torch.tensor(self.steps, dtype=torch.long, device=dev)

    @property
    def greedy_only(self) -> bool:
        return all(t == 0.0 for t in self.temperature)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    def __init__(self, model: Transformer, *, block_size: int, compile: bool = False) -> None:
        self.model = model
        self.device = model.embed.weight.device
        self.block_size = block_size
        self.num_blocks = 0  # no cache until allocate()
        self.max_positions = model.cfg.max_position_embeddings
        self.compiled = compile
        self.shapes: set[tuple] = set()  # compiled shapes seen
        if compile:
            import torch._dynamo.config as dynamo_config

            # Each (batch, width, greedy) decode shape is one specialisation of the graph:
            # room for the bounded set (batch sizes x power-of-two widths x 2), not dynamo's 8.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 128)
            dynamo_config.accumulated_recompile_limit = max(
                dynamo_config.accumulated_recompile_limit, 1024
            )
            cuda = self.device.type == "cuda"
            self._decode = torch.compile(
                self._decode_step,
                fullgraph=True,
                dynamic=False,
                mode="reduce-overhead" if cuda else None,  # CUDA graphs
            )

    def allocate(self, num_blocks: int) -> None:
        """Allocate the paged cache once: num_blocks blocks per layer, block 0 scratch.
        (Compiled graphs hold its buffers, so it is never reallocated.)"""
        if self.num_blocks:
            raise RuntimeError("the KV cache is already allocated")
        self.model.setup_caches(num_blocks, self.block_size)
        self.num_blocks = num_blocks

    def free_device_bytes(self) -> int | None:
        """Free accelerator memory (None on the CPU, where the pool is sized from the job)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free

    def kv_bytes_per_block(self) -> int:
        cfg = self.model.cfg
        return cfg.kv_bytes_per_token(self.model.embed.weight.element_size()) * self.block_size

    # ------------------------------------------------------------------ step

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        logits_index: torch.Tensor,
        sampling: SamplingTensors,
        steps: torch.Tensor,
        greedy_only: bool,
        bitmask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(tokens, positions, step, logits_index)  # (S, V)
        if bitmask is not None:  # constrained rows: tokens outside their grammar get -inf
            logits = apply_bitmask(logits, bitmask)
        tok = sample(logits, sampling, steps, greedy_only)
        return tok, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]

    def _decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        blocks: torch.Tensor,
        sampling: SamplingTensors,
        steps: torch.Tensor,
        greedy_only: bool,
        bitmask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step as one graph: (B,) tokens at (B,) positions, tables (B, n)."""
        b = tokens.shape[0]
        step = StepAttention(slots, b, (DecodeGroup(0, blocks, positions + 1),))
        index = torch.arange(b, device=tokens.device)
        return self._forward(tokens, positions, step, index, sampling, steps, greedy_only, bitmask)

    def execute(
        self, plan: StepPlan, bitmask: torch.Tensor | None = None
    ) -> tuple[list[tuple[int, float]], StepTiming]:
        """Run one step; returns (token, logprob) per sampling sequence in plan order.
        bitmask: (sampling sequences, words) allowed-token masks in plan order, or None."""
        if self.compiled and not plan.prefills:
            return self._execute_compiled_decode(plan, bitmask)
        dev, bs = self.device, self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling = _Sampling()
        index: list[int] = []
        # Decodes packed longest table first, in groups of similar width (see attention.py).
        order = sorted(range(len(plan.decodes)), key=lambda i: -len(plan.decodes[i].seq.block_table))  # fmt: skip
        groups = []
        for lo, hi in _width_groups([len(plan.decodes[i].seq.block_table) for i in order]):
            width = len(plan.decodes[order[lo]].seq.block_table)
            tables, lens = [], []
            for i in order[lo:hi]:
                s = plan.decodes[i]
                self._add_tokens(s, tokens, positions, slots)
                sampling.add(s)
                index.append(len(tokens) - 1)
                tables.append(s.seq.block_table + [NULL_BLOCK] * (width - len(s.seq.block_table)))
                lens.append(s.start + 1)
            groups.append(DecodeGroup(lo, torch.tensor(tables, device=dev), torch.tensor(lens, device=dev)))  # fmt: skip
        spans = []
        for s in plan.prefills:
            q_start = len(tokens)
            self._add_tokens(s, tokens, positions, slots)
            blocks = None
            if s.start:
                n_blocks = -(-(s.start + s.num_tokens) // bs)
                blocks = torch.tensor(s.seq.block_table[:n_blocks], device=dev)
            spans.append(PrefillSpan(q_start, s.num_tokens, s.start, blocks))
            if s.samples:
                sampling.add(s)
                index.append(len(tokens) - 1)
        step = StepAttention(
            slots=torch.tensor(slots, device=dev),
            num_decodes=len(plan.decodes),
            decodes=tuple(groups),
            prefills=tuple(spans),
        )
        t0 = time.perf_counter()
        if not index:  # only non-final prefill chunks: no token to sample
            self.model(
                torch.tensor(tokens, device=dev),
                torch.tensor(positions, device=dev),
                step,
                torch.zeros(1, dtype=torch.long, device=dev),
            )
            _sync(dev)
            return [], StepTiming(time.perf_counter() - t0)
        samp, steps = sampling.tensors(dev)
        if bitmask is not None:  # to the packed order: decodes by width, then prefills
            nd = len(order)
            bitmask = bitmask[torch.tensor(order + list(range(nd, len(index))), device=dev)]
        tok, lp = self._forward(
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            step,
            torch.tensor(index, device=dev),
            samp,
            steps,
            sampling.greedy_only,
            bitmask,
        )
        out = list(zip(tok.tolist(), lp.tolist(), strict=True))
        nd = len(order)
        decoded = [None] * nd  # back to plan order
        for j, i in enumerate(order):
            decoded[i] = out[j]
        return decoded + out[nd:], StepTiming(time.perf_counter() - t0)

    def _add_tokens(self, s: Scheduled, tokens: list, positions: list, slots: list) -> None:
        bs, table = self.block_size, s.seq.block_table
        for p in range(s.start, s.start + s.num_tokens):
            tokens.append(s.seq.token_ids[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)

    def _execute_compiled_decode(
        self, plan: StepPlan, bitmask: torch.Tensor | None
    ) -> tuple[list[tuple[int, float]], StepTiming]:
        dev, bs = self.device, self.block_size
        n = len(plan.decodes)
        b = next_pow2(n)
        width = next_pow2(max(len(s.seq.block_table) for s in plan.decodes))
        tokens, positions, slots = [], [], []
        sampling = _Sampling()
        for s in plan.decodes:
            self._add_tokens(s, tokens, positions, slots)
            sampling.add(s)
        tables = [s.seq.block_table + [NULL_BLOCK] * (width - len(s.seq.block_table)) for s in plan.decodes]  # fmt: skip
        pad = b - n  # padding rows: token 0 at position 0, written to the scratch block
        tokens += [0] * pad
        positions += [0] * pad
        slots += [NULL_BLOCK * bs] * pad
        tables += [[NULL_BLOCK] * width] * pad
        sampling.pad(pad)
        greedy_only = sampling.greedy_only
        samp, steps = sampling.tensors(dev)
        if bitmask is not None and pad:  # padding rows allow every token
            bitmask = torch.cat([bitmask, bitmask.new_full((pad, bitmask.shape[1]), -1)])
        args = (
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(tables, device=dev),
            samp,
            steps,
            greedy_only,
            bitmask,
        )
        key = ("decode", b, width, greedy_only, bitmask is not None)
        cuda_graphs = dev.type == "cuda"
        t0 = time.perf_counter()
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        tok, lp = self._decode(*args)
        out = list(zip(tok[:n].tolist(), lp[:n].tolist(), strict=True))  # the one host sync
        dt = time.perf_counter() - t0
        if key not in self.shapes:
            self.shapes.add(key)
            return out, StepTiming(0.0, dt, pad)
        return out, StepTiming(dt, 0.0, pad)
