"""Pooled rows (task embed / classify, `DecodeParams.pooling`): a prompt's final hidden states,
after the final norm (as transformers' `AutoModel` and sentence-transformers give them),
pooled into one vector per row; for `Pooling.CLASSIFY` the last token's through the
checkpoint's classifier head (model/families/classifier_head.py). Nothing is sampled, and a step of
pooled chunks only runs no LM head at all.

A pooled row runs as prefill, packed and chunked like any prompt (its `Request.score_from` is
its length: the scheduler ends it when its prompt is in). A long prompt's chunks come in
order, one a step: last-token pooling reads the final chunk's last row; mean pooling adds each
chunk's rows to a running float32 sum kept on the sequence (`Sequence.pooled`, one vector:
memory bounded by the step, not the prompt), divided by the prompt's length at its end. Mean
and CLS pooling read every prompt token, so they take no prefix-cache hit
(`Sequence.hittable_blocks`); a preempted row starts again from its first chunk.

One index_select, one norm and one index_add a step for all pooled chunks; the finished rows'
vectors are read to the host in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.params import Pooling
from batchgen.engine.sequence import Scheduled, StepPlan


@dataclass(slots=True)
class _Chunk:
    s: Scheduled
    q: int  # its first row in the step's packed tokens

    @property
    def ends(self) -> bool:
        """Does the chunk hold its prompt's last token?"""
        return self.s.start + self.s.num_tokens == self.s.seq.num_tokens

    def rows(self) -> range:
        """The packed rows it pools this step."""
        mode, s = self.s.seq.params.pooling, self.s
        if mode is Pooling.MEAN:
            return range(self.q, self.q + s.num_tokens)
        if mode is Pooling.CLS:
            return range(self.q, self.q + (s.start == 0))
        return range(self.q + s.num_tokens - 1, self.q + s.num_tokens * self.ends)


class PooledStep:
    """A step's pooled chunks: `take(h)` pools them from the step's hidden states."""

    def __init__(self, model: torch.nn.Module, chunks: list[_Chunk], only: bool) -> None:
        self.model, self.chunks = model, chunks
        self.only = only  # nothing else in the step reads logits: no LM head

    def take(self, h: torch.Tensor) -> None:
        """h: (T, dim) the step's last-layer hidden states, before the final norm. Each
        pooled sequence's running state updated; a finished one's vector set (a list)."""
        rows: list[int] = []
        seg: list[int] = []  # the chunk of each row
        for j, c in enumerate(self.chunks):
            r = c.rows()
            rows += r
            seg += [j] * len(r)
        if not rows:  # last-token chunks of prompts that go on next step
            return
        dev, long = h.device, torch.long
        hn = self.model.norm(h.index_select(0, torch.tensor(rows, device=dev, dtype=long)))
        sums = torch.zeros(len(self.chunks), hn.shape[1], device=dev, dtype=torch.float32)
        sums.index_add_(0, torch.tensor(seg, device=dev, dtype=long), hn.float())  # (chunks, dim)
        done: list[tuple[Scheduled, torch.Tensor]] = []
        last = -1  # chunk j's last row in hn
        for j, c in enumerate(self.chunks):
            seq, mode = c.s.seq, c.s.seq.params.pooling
            last += len(c.rows())
            if mode is Pooling.MEAN:
                seq.pooled = sums[j] if c.s.start == 0 else seq.pooled + sums[j]
            elif mode is Pooling.CLS and c.s.start == 0:
                seq.pooled = sums[j]
            if not c.ends:
                continue
            if mode is Pooling.MEAN:
                vec = seq.pooled / seq.num_tokens
            elif mode is Pooling.CLS:
                vec = seq.pooled
            elif mode is Pooling.CLASSIFY:  # the head on the model's dtype, as transformers'
                vec = self.model.score(hn[last : last + 1])[0]
            else:
                vec = hn[last]
            done.append((c.s, vec.float()))
        if done:
            out = torch.stack([v for _, v in done]).tolist()  # the host read
            for (s, _), vec in zip(done, out, strict=True):
                s.seq.pooled = vec


def pooled_step(
    model: torch.nn.Module,
    plan: StepPlan,
    spans: list[tuple[int, int, int, list[int] | None]],
    skip_head: bool = True,
) -> PooledStep | None:
    """The step's pooled chunks (None: none). spans: the packed prefills, in plan order (their
    first packed row first). skip_head: a step of pooled rows only runs no LM head (False
    where other ranks run it in step: tensor parallelism's collectives)."""
    chunks = [
        _Chunk(s, q)
        for s, (q, *_) in zip(plan.prefills, spans, strict=True)
        if s.seq.params.pooling is not None
    ]
    if not chunks:
        return None
    others = plan.decodes or any(s.seq.params.pooling is None for s in plan.prefills)
    return PooledStep(model, chunks, only=skip_head and not others)
