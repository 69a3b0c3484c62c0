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
plan the next step. A scored candidate's chunk (the score task) adds its scored positions
to the LM head's rows: the log-probability of each next token, nothing sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchgen.engine.block_pool import NULL_BLOCK
from batchgen.engine.constraints import apply_bitmask
from batchgen.engine.sampler import SamplingColumns, SamplingTensors, sample
from batchgen.engine.sequence import Scheduled, StepPlan
from batchgen.model.attention import DecodeGroup, PrefillSpan, StepAttention
from batchgen.model.transformer import Transformer


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _width_groups(
    widths: list[int], max_groups: int = 4, keep: float = 0.6
) -> list[tuple[int, int]]:
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
    new_shape: bool = False  # a compiled shape's first call


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

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        sampling: SamplingTensors,
        steps: torch.Tensor,
        greedy_only: bool,
        bitmask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        logits = self.model(tokens, positions, step, torch.arange(b, device=tokens.device))
        return self._sample(logits, sampling, steps, greedy_only, bitmask)

    def execute(
        self, plan: StepPlan, bitmask: torch.Tensor | None = None
    ) -> tuple[list[tuple[int, float]], list[list[float]], StepTiming]:
        """Run one step; returns (token, logprob) per sampling sequence in plan order, and
        the scored tokens' log-probabilities per scored candidate's chunk in plan order.
        bitmask: (sampling sequences, words) allowed-token masks in plan order, or None."""
        if self.compiled and not plan.prefills:
            return self._execute_compiled_decode(plan, bitmask)
        dev, bs = self.device, self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling = SamplingColumns()
        index: list[int] = []
        # Decodes packed longest table first, in groups of similar width (see attention.py).
        order = sorted(
            range(len(plan.decodes)), key=lambda i: -len(plan.decodes[i].seq.block_table)
        )
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
            groups.append(
                DecodeGroup(lo, torch.tensor(tables, device=dev), torch.tensor(lens, device=dev))
            )
        spans = []
        scored: list[list[int]] = []  # per scored chunk: its positions in the step's tokens
        targets: list[int] = []  # the token each scored position predicts
        for s in plan.prefills:
            q_start = len(tokens)
            if s.seq.request.scoring:
                rows = self._scored_positions(s)
                scored.append([q_start + p - s.start for p in rows])
                targets += [s.seq.token_ids[p + 1] for p in rows]
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
        score_index = [i for rows in scored for i in rows]
        t0 = time.perf_counter()
        logits = self.model(
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            step,
            torch.tensor(index + score_index or [0], device=dev),  # [0]: nothing is read
        )
        score_lp: list[float] = []
        if score_index:
            lp = logits[len(index) :].float().log_softmax(-1)
            score_lp = lp.gather(-1, torch.tensor(targets, device=dev)[:, None])[:, 0].tolist()
        per_chunk, at = [], 0
        for rows in scored:
            per_chunk.append(score_lp[at : at + len(rows)])
            at += len(rows)
        if not index:  # prefill chunks that sample nothing
            _sync(dev)
            return [], per_chunk, StepTiming(time.perf_counter() - t0)
        samp, steps = sampling.tensors(dev)
        if bitmask is not None:  # to the packed order: decodes by width, then prefills
            nd = len(order)
            bitmask = bitmask[torch.tensor(order + list(range(nd, len(index))), device=dev)]
        tok, lp = self._sample(logits[: len(index)], samp, steps, sampling.greedy_only, bitmask)
        out = list(zip(tok.tolist(), lp.tolist(), strict=True))
        nd = len(order)
        decoded = [None] * nd  # back to plan order
        for j, i in enumerate(order):
            decoded[i] = out[j]
        return decoded + out[nd:], per_chunk, StepTiming(time.perf_counter() - t0)

    @staticmethod
    def _scored_positions(s: Scheduled) -> range:
        """Positions of chunk s whose logits score a candidate token (the next one): from
        the one before the first scored token to the one before the last token."""
        seq = s.seq
        lo = max(s.start, seq.request.score_from - 1)
        return range(lo, min(s.start + s.num_tokens, seq.num_tokens - 1))

    def _add_tokens(self, s: Scheduled, tokens: list, positions: list, slots: list) -> None:
        bs, table = self.block_size, s.seq.block_table
        for p in range(s.start, s.start + s.num_tokens):
            tokens.append(s.seq.token_ids[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)

    def _execute_compiled_decode(
        self, plan: StepPlan, bitmask: torch.Tensor | None
    ) -> tuple[list[tuple[int, float]], list[list[float]], StepTiming]:
        dev, bs = self.device, self.block_size
        n = len(plan.decodes)
        b = next_pow2(n)
        width = next_pow2(max(len(s.seq.block_table) for s in plan.decodes))
        tokens, positions, slots = [], [], []
        sampling = SamplingColumns()
        for s in plan.decodes:
            self._add_tokens(s, tokens, positions, slots)
            sampling.add(s)
        tables = [
            s.seq.block_table + [NULL_BLOCK] * (width - len(s.seq.block_table))
            for s in plan.decodes
        ]
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
            return out, [], StepTiming(0.0, dt, pad, new_shape=True)
        return out, [], StepTiming(dt, 0.0, pad)
