"""A step plan packed into the model's inputs, as numpy arrays (no torch).

A step's tokens run flat: the decodes first, then each prefill chunk, packed with no padding
rows and no padding tokens. Each token carries its position and its cache slot
(block_table[pos // block_size] * block_size + pos % block_size). Decodes are packed longest
block table first, in a few groups of similar width (each group is one attention call over its
gathered blocks, see model/attention/step.py); each prefill chunk is a span with the blocks of its
cached context. `logits_index` names the tokens that reach the LM head: those that sample,
then the positions of scored tokens (a score task's labels, a row's prompt logprobs).

A compiled step runs at a bounded set of token counts on a GPU (`token_sizes`, its CUDA
graphs'): the runner pads its tokens to the next one (engine/compiled_forward.py); padding
tokens decode token 0 at position 0 into the scratch block and attend to nothing.

`StepInputs` is everything a model forward needs, so it is also what rank 0 sends the other
tensor-parallel ranks each step; `PackedStep` adds what only rank 0 needs to sample and score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgen.engine.block_pool import NULL_BLOCK
from batchgen.engine.block_table import BlockTables
from batchgen.engine.sequence import Scheduled, StepPlan
from batchgen.model.config import LongRopeRows


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded row counts of compiled sampling for up to max_num_seqs rows: 2, 4, then
    multiples of 8, the last at or above max_num_seqs (a CUDA graph each on a GPU)."""
    sizes = [2, 4]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8 if sizes[-1] >= 8 else 8)
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


def padded_batch(n: int) -> int:
    """The capture size a step sampling n rows samples at (capture_sizes)."""
    return 2 if n <= 2 else 4 if n <= 4 else -(-n // 8) * 8


# The largest token count recorded as CUDA graphs (vLLM's default): larger steps are mostly
# prefill, whose matmuls leave little launch overhead for a graph to save.
TOKEN_CAP = 512


def token_sizes(max_tokens: int) -> list[int]:
    """The token counts a GPU's compiled forward records CUDA graphs at: 2, 4, 8, then steps
    of 8 to min(TOKEN_CAP, max_tokens) (66 at the defaults)."""
    return capture_sizes(min(TOKEN_CAP, max_tokens))


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class StepInputs:
    """One forward's inputs, numpy int64 arrays (T,) and (S,). decodes: (first token, block
    tables (B, n), context lengths (B,)) per group; prefills: (first token, length, tokens
    already cached, their blocks (n,) or None). The runner copies them to the device in one
    piece (engine/input_buffer.py)."""

    tokens: np.ndarray = field(default_factory=_empty)
    positions: np.ndarray = field(default_factory=_empty)  # a longrope model's: RoPE table rows
    slots: np.ndarray = field(default_factory=_empty)
    logits_index: np.ndarray = field(default_factory=_empty)
    decodes: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    prefills: list[tuple[int, int, int, np.ndarray | None]] = field(default_factory=list)
    save_compile_cache: bool = False  # the warm-up's last step: each rank saves its artifacts

    def pad(self, tokens: int, slot: int) -> None:
        """Pad to `tokens` tokens: token 0 at position 0, its key written at `slot`."""
        n = tokens - len(self.tokens)
        if n > 0:
            zeros = np.zeros(n, dtype=np.int64)
            self.tokens = np.concatenate([self.tokens, zeros])
            self.positions = np.concatenate([self.positions, zeros])
            self.slots = np.concatenate([self.slots, np.full(n, slot, dtype=np.int64)])


@dataclass(slots=True)
class PackedStep:
    """A plan packed: the model inputs, and for rank 0 the rows that sample (in packed
    order), where each decode went, and the score task's positions."""

    inputs: StepInputs
    sampled: list[Scheduled]  # the rows that sample, in the order of inputs.logits_index
    decode_order: list[int]  # packed decode j is plan.decodes[decode_order[j]]
    scored: list[list[int]] = field(default_factory=list)  # per scored chunk: logits rows
    targets: list[int] = field(default_factory=list)  # the token each scored row predicts


def width_groups(
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


def _scored_positions(s: Scheduled) -> range:
    """Positions of chunk s whose logits score a token (the next one, `Request.scored`): from
    the one before the first scored token to the one before the last."""
    scored = s.seq.request.scored
    lo = max(s.start, scored.start - 1)
    return range(lo, min(s.start + s.num_tokens, scored.stop - 1))


def _pack_decodes(
    decodes: list[Scheduled], tables: BlockTables, bs: int, max_groups: int, rope
) -> tuple[StepInputs, list[int]]:
    """The decodes, longest context first, in at most max_groups width groups: each group's
    tables are one slice of the persistent block tables, as wide as its longest context."""
    n = len(decodes)
    pos = np.fromiter((s.start for s in decodes), dtype=np.int64, count=n)
    order = np.argsort(-pos, kind="stable")
    seqs = [decodes[i].seq for i in order.tolist()]
    rows, pos = tables.rows(seqs), pos[order]
    used = pos // bs + 1  # (B,) blocks each row reads, this token's included
    x = StepInputs()
    last = zip(seqs, pos.tolist(), strict=True)
    x.tokens = np.fromiter((q.token_ids[p] for q, p in last), np.int64, n)
    x.slots = tables.table[rows, pos // bs].astype(np.int64) * bs + pos % bs
    x.positions = pos
    if rope is not None:  # a longrope model's tokens carry their RoPE table row
        x.positions = pos + np.fromiter(
            (rope.rows(q.num_tokens, 0, 1)[0] for q in seqs), np.int64, n
        )
    for lo, hi in width_groups(used.tolist(), max_groups):
        x.decodes.append((lo, tables.table[rows[lo:hi], : used[lo]], pos[lo:hi] + 1))
    x.logits_index = np.arange(n, dtype=np.int64)
    return x, order.tolist()


def pack_step(
    plan: StepPlan,
    tables: BlockTables,
    block_size: int,
    max_groups: int = 4,
    rope: LongRopeRows | None = None,
) -> PackedStep:
    """The plan at its exact size: decodes in at most max_groups width groups, then prefill
    spans, as numpy arrays. tables: the persistent block tables, brought up to date here.
    rope: a longrope model's table rows, which its positions become."""
    bs = block_size
    inputs, order = (
        _pack_decodes(plan.decodes, tables, bs, max_groups, rope)
        if plan.decodes
        else (StepInputs(), [])
    )
    packed = PackedStep(inputs, [plan.decodes[i] for i in order], order)
    tokens, positions, slots = [inputs.tokens], [inputs.positions], [inputs.slots]
    index, score_rows, q_start = [inputs.logits_index], [], len(inputs.tokens)
    for s in plan.prefills:
        seq, start, stop = s.seq, s.start, s.start + s.num_tokens
        if seq.request.scored is not None:
            rows = _scored_positions(s)
            packed.scored.append([q_start + p - start for p in rows])
            packed.targets += [seq.token_ids[p + 1] for p in rows]
        r, p = tables.row(seq), np.arange(start, stop, dtype=np.int64)
        tokens.append(np.array(seq.token_ids[start:stop], dtype=np.int64))
        slots.append(tables.table[r, p // bs].astype(np.int64) * bs + p % bs)
        positions.append(p if rope is None else np.array(rope.rows(seq.num_tokens, start, stop)))
        blocks = tables.table[r, : -(-stop // bs)].copy() if start else None
        inputs.prefills.append((q_start, s.num_tokens, start, blocks))
        q_start += s.num_tokens
        if s.samples:
            packed.sampled.append(s)
            index.append(np.array([q_start - 1]))
    for rows in packed.scored:
        score_rows += rows
    index.append(np.array(score_rows, dtype=np.int64))
    inputs.tokens, inputs.positions, inputs.slots = (
        np.concatenate(v).astype(np.int64, copy=False) for v in (tokens, positions, slots)
    )
    inputs.logits_index = np.concatenate(index).astype(np.int64, copy=False)
    if not len(inputs.logits_index):  # prefill chunks that sample nothing: one row, not read
        inputs.logits_index = np.zeros(1, dtype=np.int64)
    return packed


def warmup_decode(rows: int, tokens: int, block_size: int) -> StepInputs:
    """A warm-up step of `tokens` tokens whose first `rows` decode (one group) and the rest
    pad: every token is token 0 at position 0, its key written to the scratch block."""
    return StepInputs(
        tokens=np.zeros(tokens, dtype=np.int64),
        positions=np.zeros(tokens, dtype=np.int64),
        slots=np.full(tokens, NULL_BLOCK * block_size, dtype=np.int64),
        logits_index=np.arange(rows, dtype=np.int64),
        decodes=[(0, np.full((rows, 2), NULL_BLOCK, np.int32), np.ones(rows, np.int64))],
    )


@dataclass(slots=True)
class WarmUp:
    """What the warm-up cost, and whether the compile cache had the graphs."""

    compile_seconds: float = 0.0
    capture_seconds: float = 0.0
    cache: str | None = None  # "hit" or "miss"; None: no compile cache
    graphs_compiled: int = 0  # by inductor, at warm-up (torch's counters)
    graphs_loaded: int = 0  # from inductor's cache instead (a compile cache's hits)
    warmup_seconds: float = 0.0  # eager: the warm-up steps (step_inputs.warmup_eager)


# The eager warm-up's prompt spans: long enough to run the step's matmuls at full size, short
# enough that their attention (quadratic in a span) costs little next to them.
WARMUP_SPAN = 128


def warmup_eager(max_tokens: int, max_rows: int, block_size: int, positions: int) -> list:
    """The eager warm-up's steps: a prefill of max_tokens tokens in spans of WARMUP_SPAN, then
    a decode of max_rows rows, every key written to the scratch block. Their first run pays the
    process's one-off costs (the allocator growing to a step's peak, the math libraries' first
    calls), which would otherwise land in the first real steps and their rows' TTFT."""
    spans = [(q, min(WARMUP_SPAN, max_tokens - q)) for q in range(0, max_tokens, WARMUP_SPAN)]
    prefill = StepInputs(
        tokens=np.zeros(max_tokens, dtype=np.int64),
        positions=np.array([p % positions for _, n in spans for p in range(n)], dtype=np.int64),
        slots=np.full(max_tokens, NULL_BLOCK * block_size, dtype=np.int64),
        logits_index=np.array([q + n - 1 for q, n in spans], dtype=np.int64),
        prefills=[(q, n, 0, None) for q, n in spans],
    )
    return [prefill, warmup_decode(max_rows, max_rows, block_size)]
