"""vLLM's penalties on a step's raw logits, before temperature, top-k, top-p and min_p (as vLLM
applies them): each row's `logit_bias` added, then `repetition_penalty` (a logit > 0 divided by
it, < 0 multiplied) on tokens of its prompt or output so far, then `presence_penalty` x (count
> 0) and `frequency_penalty` x count subtracted for tokens of its output. Both the eager and the
compiled decode run it, on the logits the sampling graph then takes: a step where no row asks
costs one pass over its rows' parameters on the host and nothing on the device; the compiled
sampling graph takes no new input and no new guard.

Only a row's seen tokens change, so only they are touched: a step gathers the penalized rows'
logits at their seen tokens, penalizes those and scatters them back, (P, W) elements for W
the most distinct tokens a row has seen, not (P, V). At 256 rows x 32k vocabulary a pass over
(P, V) per operation cost ~290 ms a step on 2 CPU cores (ten of them, each a fresh 32 MB
buffer); rows of a few hundred tokens cost milliseconds here.

State lives on the device (`TokenCounts`): a slot per penalized sequence in flight holds its
output's token counts (int32, (V,)) and its seen tokens, distinct, in the order first seen
(its prompt's, then its output's; int64, a row of a table grown in powers of two, unfilled
columns repeating the row's first token, so they gather and scatter that token's own value).
The host keeps each slot's set of seen tokens, so each step sends only the tokens sampled
since the last (one a row), scattered into the counts, and appended to the table when new.
A slot is keyed by its sequence and freed when it is no longer running; a preempted row gets
a new slot on its return, filled from its tokens (which preemption keeps), so its counts are
right after a recompute; so are n samples' (a sequence each) and prefix-cached prompts'
(counts come from token ids, not from the cache).
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import Scheduled, SeqState, SeqStatus


class TokenCounts:
    """Per penalized sequence in flight: its output's token counts and its seen tokens."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)  # (slots, V)
        self.seen = torch.zeros(0, 8, dtype=torch.long, device=device)  # (slots, width)
        self.slot_of: dict[SeqState, int] = {}
        self.counted: dict[SeqState, int] = {}  # output tokens already in its counts
        self.known: dict[int, dict[int, None]] = {}  # slot -> its seen tokens, in table order
        self.free: list[int] = []

    def slots(self, seqs: list[SeqState]) -> tuple[torch.Tensor, int]:
        """The slots of seqs (all running), their state brought up to their tokens now, and
        the table width their seen tokens fill."""
        for seq in [s for s in self.slot_of if s.status is not SeqStatus.RUNNING]:
            self.free.append(slot := self.slot_of.pop(seq))
            del self.counted[seq], self.known[slot]
        new = [seq for seq in seqs if seq not in self.slot_of]
        if len(new) > len(self.free):
            self._grow(len(self.slot_of) + len(new))
        rows, toks, cells, ids = [], [], [], []
        for seq in new:
            slot = self.slot_of[seq] = self.free.pop()
            self.counted[seq] = 0
            self.counts[slot].zero_()
            known = self.known[slot] = dict.fromkeys(seq.request.prompt_ids)
            self._widen(len(known))
            self.seen[slot] = seq.request.prompt_ids[0]
            self.seen[slot, : len(known)] = torch.tensor(list(known), device=self.device)
        for seq in seqs:
            slot, done = self.slot_of[seq], self.counted[seq]
            added = seq.token_ids[seq.prompt_len + done :]  # one token a step, all on a new slot
            rows += [slot] * len(added)
            toks += added
            self.counted[seq] = done + len(added)
            known = self.known[slot]
            for t in added:
                if t not in known:
                    cells.append((slot, len(known)))
                    ids.append(t)
                    known[t] = None
        if toks:
            ones = torch.ones(len(toks), dtype=torch.int32, device=self.device)
            index = (torch.tensor(rows, device=self.device), torch.tensor(toks, device=self.device))
            self.counts.index_put_(index, ones, accumulate=True)
        width = max(len(self.known[self.slot_of[seq]]) for seq in seqs)
        if ids:
            self._widen(width)
            index = tuple(torch.tensor(c, device=self.device) for c in zip(*cells, strict=True))
            self.seen.index_put_(index, torch.tensor(ids, device=self.device))
        return torch.tensor([self.slot_of[seq] for seq in seqs], device=self.device), width

    def _grow(self, need: int) -> None:
        have = self.counts.shape[0]
        size = max(8, 1 << (need - 1).bit_length())
        self.counts = torch.cat([self.counts, self.counts.new_zeros(size - have, self.vocab)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(size - have, self.seen.shape[1])])
        self.free += range(size - 1, have - 1, -1)  # popped lowest first

    def _widen(self, need: int) -> None:
        have = self.seen.shape[1]
        if need > have:  # new columns repeat each row's first token
            more = (1 << (need - 1).bit_length()) - have
            self.seen = torch.cat([self.seen, self.seen[:, :1].expand(-1, more)], dim=1)


def apply_penalties(
    logits: torch.Tensor, sampled: list[Scheduled], counts: TokenCounts
) -> torch.Tensor:
    """logits (rows, V) float32 of the sampling rows `sampled` (their first rows, in order)
    with each row's logit_bias and penalties applied, in place."""
    bias = [(i, t, b) for i, s in enumerate(sampled) for t, b in s.seq.params.logit_bias]
    if bias:  # (row, token) pairs: a scatter of their few values, no pass over (B, V)
        rows, toks, vals = zip(*bias, strict=True)
        dev = logits.device
        index = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=dev), True)
    pen = [(i, s.seq) for i, s in enumerate(sampled) if s.seq.params.penalized]
    if not pen:
        return logits
    rows = torch.tensor([i for i, _ in pen], device=logits.device)[:, None]
    params = [seq.params for _, seq in pen]
    slots, width = counts.slots([seq for _, seq in pen])
    ids = counts.seen[slots, :width]  # (P, W): each row's seen tokens (a repeated first pads)
    x = logits[rows, ids]  # (P, W)
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = torch.tensor([p.repetition_penalty for p in params], device=x.device)[:, None]
        x = torch.where(x > 0, x / rep, x * rep)  # every token in ids is seen
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        n = counts.counts[slots[:, None], ids]  # (P, W) int32: 0 for prompt-only tokens
        pres = torch.tensor([p.presence_penalty for p in params], device=x.device)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=x.device)[:, None]
        x = x - freq * n - pres * (n > 0)
    logits[rows, ids] = x  # a repeated token is written its one value more than once
    return logits
