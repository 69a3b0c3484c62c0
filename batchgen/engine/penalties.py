"""vLLM's penalties on a step's raw logits, before temperature, top-k, top-p and min_p (as vLLM
applies them): each row's `logit_bias` added, then `repetition_penalty` (a logit > 0 divided by
it, < 0 multiplied) on tokens of its prompt or output so far, then `presence_penalty` x (count
> 0) and `frequency_penalty` x count subtracted for tokens of its output. Both the eager and the
compiled decode run it, on the logits the sampling graph then takes: a step where no row asks
costs one pass over its rows' parameters on the host and nothing on the device; the compiled
sampling graph takes no new input and no new guard.

Counts live on the device (`TokenCounts`): a slot per penalized sequence in flight holds its
output's token counts (int32) and its prompt's tokens (bool), 5 bytes x vocabulary a row, 195
MB at 256 rows x 152k vocabulary, allocated at the first penalized row and grown in powers of
two up to the rows in flight. Each step sends only the tokens sampled since the last (one a
row), scattered into the counts. The other way, each row's whole token list as a padded (B, L)
tensor made each step, moves B x L ids from the host every step (256 x 4k tokens: 1M Python
ints, tens of ms) to save memory a GPU has. A slot is keyed by its sequence and freed when it
is no longer running; a preempted row gets a new slot on its return, filled from its tokens
(which preemption keeps), so its counts are right after a recompute; so are n samples' (a
sequence each) and prefix-cached prompts' (counts come from token ids, not from the cache).
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import Scheduled, SeqStatus, Sequence


class TokenCounts:
    """Per penalized sequence in flight: its output's token counts and its prompt's tokens."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)  # (slots, V)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)  # (slots, V)
        self.slot_of: dict[Sequence, int] = {}
        self.counted: dict[Sequence, int] = {}  # output tokens already in its counts
        self.free: list[int] = []

    def slots(self, seqs: list[Sequence]) -> torch.Tensor:
        """The slots of seqs (all running), their counts brought up to their tokens now."""
        for seq in [s for s in self.slot_of if s.status is not SeqStatus.RUNNING]:
            self.free.append(self.slot_of.pop(seq))
            del self.counted[seq]
        new = [seq for seq in seqs if seq not in self.slot_of]
        if len(new) > len(self.free):
            self._grow(len(self.slot_of) + len(new))
        rows, toks = [], []
        for seq in new:
            slot = self.slot_of[seq] = self.free.pop()
            self.counted[seq] = 0
            self.counts[slot].zero_()
            self.prompt[slot].zero_()
            self.prompt[slot, torch.tensor(seq.request.prompt_ids, device=self.device)] = True
        for seq in seqs:
            slot, done = self.slot_of[seq], self.counted[seq]
            added = seq.token_ids[seq.prompt_len + done :]  # one token a step, all on a new slot
            rows += [slot] * len(added)
            toks += added
            self.counted[seq] = done + len(added)
        if toks:
            ones = torch.ones(len(toks), dtype=torch.int32, device=self.device)
            index = (torch.tensor(rows, device=self.device), torch.tensor(toks, device=self.device))
            self.counts.index_put_(index, ones, accumulate=True)
        return torch.tensor([self.slot_of[seq] for seq in seqs], device=self.device)

    def _grow(self, need: int) -> None:
        have = self.counts.shape[0]
        size = max(8, 1 << (need - 1).bit_length())
        self.counts = torch.cat([self.counts, self.counts.new_zeros(size - have, self.vocab)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(size - have, self.vocab)])
        self.free += range(size - 1, have - 1, -1)  # popped lowest first


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
    rows = torch.tensor([i for i, _ in pen], device=logits.device)
    params = [seq.params for _, seq in pen]
    slots = counts.slots([seq for _, seq in pen])
    x = logits[rows]  # (P, V): the penalized rows only
    n = counts.counts[slots]  # (P, V) int32
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = torch.tensor([p.repetition_penalty for p in params], device=x.device)[:, None]
        seen = counts.prompt[slots] | (n > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        pres = torch.tensor([p.presence_penalty for p in params], device=x.device)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=x.device)[:, None]
        x = x - freq * n - pres * (n > 0)
    return logits.index_copy_(0, rows, x)
