"""Hand-made engine steps for model-level tests: block tables kept here, StepAttention
built as the model runner builds it, Transformer.forward called directly."""

from __future__ import annotations

import random

import torch

from batchgen.model.attention.step import DecodeGroup, PrefillSpan, StepAttention
from batchgen.model.families.transformer import Transformer


class Pages:
    """A paged cache with block tables by hand. Blocks come from a shuffled free list, so a
    sequence's cache is never contiguous; block 0 is scratch, as in the engine."""

    def __init__(
        self, model: Transformer, num_blocks: int = 64, block_size: int = 4, seed: int = 0
    ):
        model.setup_caches(num_blocks, block_size)
        self.model, self.bs = model, block_size
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def share(self, src: int, dst: int, n_blocks: int) -> None:
        """Sequence dst starts with src's first n_blocks blocks (a prefix-cache hit)."""
        self.tables[dst] = self.tables[src][:n_blocks]

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.bs:
            table.append(self.free.pop())
        return table[pos // self.bs] * self.bs + pos % self.bs

    def step(self, decodes=(), prefills=(), all_logits: bool = False, groups=None) -> torch.Tensor:
        """One packed step. decodes: (seq, position, token) each; prefills: (seq, start,
        tokens) each, `start` tokens of it already cached; groups: sizes the decodes are
        attended in (default: one group). Returns the float32 logits (S, V) of each decode,
        then of each prefill's last token (of every prefill token: all_logits)."""
        tokens, positions, slots, index, spans = [], [], [], [], []
        for seq, pos, tok in decodes:
            tokens.append(tok)
            positions.append(pos)
            slots.append(self._slot(seq, pos))
            index.append(len(tokens) - 1)
        for seq, start, toks in prefills:
            q_start = len(tokens)
            for j, tok in enumerate(toks):
                tokens.append(tok)
                positions.append(start + j)
                slots.append(self._slot(seq, start + j))
            blocks = None
            if start:
                n_blocks = -(-(start + len(toks)) // self.bs)
                blocks = torch.tensor(self.tables[seq][:n_blocks], device=self._device)
            spans.append(PrefillSpan(q_start, len(toks), start, blocks))
            index += list(range(q_start, len(tokens))) if all_logits else [len(tokens) - 1]
        dev = self._device
        decode_groups, lo = [], 0
        for size in groups or ([len(decodes)] if decodes else []):
            group = decodes[lo : lo + size]
            width = max(len(self.tables[seq]) for seq, _, _ in group)
            tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _, _ in group]
            lens = [p + 1 for _, p, _ in group]
            decode_groups.append(
                DecodeGroup(lo, torch.tensor(tables, device=dev), torch.tensor(lens, device=dev))
            )
            lo += size
        assert lo == len(decodes)
        step = StepAttention(
            slots=torch.tensor(slots, device=dev),
            num_decodes=len(decodes),
            decodes=tuple(decode_groups),
            prefills=tuple(spans),
        )
        with torch.no_grad():  # (not inference_mode: quanto's int4 weights refuse it)
            return self.model(
                torch.tensor(tokens, device=dev),
                torch.tensor(positions, device=dev),
                step,
                torch.tensor(index, device=dev),
            )

    @property
    def _device(self) -> torch.device:
        return self.model.embed.weight.device


def last_logits(model: Transformer, rows: list[list[int]] | torch.Tensor) -> torch.Tensor:
    """(B, V) logits of each row's last token, all rows prefilled in one packed step."""
    rows = [list(map(int, r)) for r in rows]
    pages = Pages(model, num_blocks=1 + sum(-(-len(r) // 4) for r in rows))
    return pages.step(prefills=[(i, 0, r) for i, r in enumerate(rows)])


def all_logits(model: Transformer, row: list[int]) -> torch.Tensor:
    """(T, V) logits of every position of one row, prefilled from an empty cache."""
    pages = Pages(model, num_blocks=1 + -(-len(row) // 4))
    return pages.step(prefills=[(0, 0, list(row))], all_logits=True)
