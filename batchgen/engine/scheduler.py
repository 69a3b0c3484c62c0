"""Schedulers: plain Python, no torch.

Each owns the lifecycle of every request of one planning window: WAITING until it is
handed out, RUNNING while the runner has it, FINISHED once its completion is back.

- StaticScheduler hands out the planner's length-bucketed batches (longest bucket first);
  a batch runs until its last row finishes.
- ContinuousScheduler keeps a fixed number of cache slots decoding together and refills
  the slots of finished rows with waiting prompts (see ContinuousScheduler.schedule).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from batchgen.engine.sequence import Request
from batchgen.planner import BatchPlan, BucketConfig, Plan, next_pow2, plan_batches


class Schedule(str, enum.Enum):
    STATIC = "static"
    CONTINUOUS = "continuous"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class _Lifecycle:
    """Request statuses of one window, shared by both schedulers."""

    requests: list[Request]
    status: list[SeqStatus]

    @property
    def num_finished(self) -> int:
        return sum(s is SeqStatus.FINISHED for s in self.status)

    @property
    def is_done(self) -> bool:
        return self.num_finished == len(self.requests)


class StaticScheduler(_Lifecycle):
    def __init__(self, requests: Sequence[Request], buckets: BucketConfig) -> None:
        self.requests = list(requests)
        self.plan: Plan = plan_batches(
            [r.prompt_len for r in self.requests],
            [r.params.max_new_tokens for r in self.requests],
            buckets,
        )
        self.status = [SeqStatus.WAITING] * len(self.requests)
        self._next = 0

    def next_batch(self) -> tuple[BatchPlan, list[Request]] | None:
        if self._next >= len(self.plan.batches):
            return None
        batch = self.plan.batches[self._next]
        self._next += 1
        for i in batch.indices:
            self.status[i] = SeqStatus.RUNNING
        return batch, [self.requests[i] for i in batch.indices]

    def finish(self, batch: BatchPlan) -> None:
        for i in batch.indices:
            if self.status[i] is not SeqStatus.RUNNING:
                raise RuntimeError(f"request {i} finished while {self.status[i].value}")
            self.status[i] = SeqStatus.FINISHED


@dataclass(slots=True, frozen=True)
class SlotShape:
    """The one decode shape of a continuous window: `slots` rows of row_stride cache slots."""

    slots: int
    prompt_len: int  # the longest prompt bucket of the window (of its suffixes, with a prefix)
    max_new: int  # new-token bucket
    prefix_len: int = 0  # a prefix every prompt shares, prefilled once (0: none)

    @property
    def row_stride(self) -> int:
        return self.prefix_len + self.prompt_len + self.max_new

    @property
    def extra_rows(self) -> int:
        """Rows past the slots: a scratch row that a refill's padding rows write to (so they
        never touch a decoding row), and the shared prefix's row."""
        return 2 if self.prefix_len else 1

    @property
    def kv_tokens(self) -> int:
        return (self.slots + self.extra_rows) * self.row_stride


def shared_prefix_len(prompts: Sequence[Sequence[int]], min_len: int, multiple: int) -> int:
    """The longest common token prefix of `prompts`, cut down to a multiple of `multiple`
    and leaving every prompt at least one token of its own (its last token's logits start
    its generation); 0 if that is under min_len or there are fewer than two prompts."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    n -= n % multiple
    return n if n >= min_len else 0


@dataclass(slots=True, frozen=True)
class Refill:
    """Prefill `indices` (positions in the window's request list) into the cache rows
    `slots`, one each, left-padded to prompt_len, as a batch padded to batch_size rows.
    With a shared prefix, what is prefilled is each prompt's suffix after it."""

    slots: tuple[int, ...]
    indices: tuple[int, ...]
    prompt_len: int  # bucket edge
    batch_size: int  # power of two >= len(indices), <= the window's slots

    @property
    def computed_prompt_tokens(self) -> int:
        return self.batch_size * self.prompt_len


MIN_PREFIX = 16  # shortest shared prefix worth reusing; prefixes are cut to multiples of it


class Action(enum.Enum):
    REFILL = "refill"  # prefill waiting prompts into free slots, then decode
    DECODE = "decode"  # decode the running rows
    DONE = "done"  # every request finished


@dataclass(slots=True, frozen=True)
class Step:
    action: Action
    refill: Refill | None = None  # set exactly when action is REFILL

    def __post_init__(self) -> None:
        if (self.action is Action.REFILL) != (self.refill is not None):
            raise ValueError(f"{self.action}: refill must be given exactly for REFILL")


@dataclass(slots=True, frozen=True)
class RoundReport:
    """What a continuous round yields alongside its finished rows, in place of a BatchPlan."""

    computed_prompt_tokens: int  # prefill tokens (padding included) since the last report


class ContinuousScheduler(_Lifecycle):
    """Slots decode together in one shape; finished rows' slots are refilled.

    The window's requests wait in order of prompt length, longest first (so refills group
    similar lengths and the largest prefill shape comes first). The decode shape is fixed
    for the window: its longest prompt bucket plus its new-token bucket per row, and as
    many slots as the bucket budgets allow for that row length (fewer if the window is
    small). `schedule()` is called after each decode round: if slots are free and prompts
    wait, it plans a refill of as many of them as fit into the free slots (lowest slot
    first) and share the longest one's length bucket, padded to a power-of-two count (it
    is called again until no slot is free or no prompt waits); otherwise it asks for
    another decode round while rows run, and says DONE when none run and none wait. The
    runner reports finished rows with `finish(slot)`, which frees the slot.
    """

    def __init__(
        self, requests: Sequence[Request], buckets: BucketConfig, prefix_reuse: bool = False
    ) -> None:
        self.requests = list(requests)
        self.buckets = buckets
        self.status = [SeqStatus.WAITING] * len(self.requests)
        # With prefix reuse, rows are prefilled from the end of the shared prefix on: the
        # buckets, the order and the refills are about the suffixes.
        self.prefix_len = (
            shared_prefix_len([r.prompt_ids for r in self.requests], MIN_PREFIX, MIN_PREFIX)
            if prefix_reuse
            else 0
        )
        lens = [r.prompt_len - self.prefix_len for r in self.requests]
        self._lens = lens
        order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
        self.waiting: deque[int] = deque(order)
        self.running: dict[int, int] = {}  # slot -> request index
        prompt_len = buckets.prompt_bucket(max(lens, default=1))
        max_new = buckets.new_tokens_bucket(
            max((r.params.max_new_tokens for r in self.requests), default=1)
        )
        stride = self.prefix_len + prompt_len + max_new
        slots = min(buckets.batch_size(stride - max_new, max_new), next_pow2(max(len(lens), 1)))
        extra = 2 if self.prefix_len else 1
        while slots > 1 and (slots + extra) * stride > buckets.kv_capacity_tokens:
            slots //= 2
        self.shape = SlotShape(slots, prompt_len, max_new, self.prefix_len)
        if self.shape.kv_tokens > buckets.kv_capacity_tokens:
            raise ValueError(
                f"a continuous batch needs {self.shape.kv_tokens} KV cache tokens "
                f"({1 + extra} rows of {stride}); the cache holds {buckets.kv_capacity_tokens}"
            )

    @property
    def prefix_tokens_saved(self) -> int:
        """Prompt tokens not prefilled thanks to the shared prefix (prefilled once, not per row)."""
        return self.prefix_len * (len(self.requests) - 1) if self.prefix_len else 0

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.shape.slots) if s not in self.running]

    def schedule(self) -> Step:
        free = self.free_slots
        if free and self.waiting:
            # one length bucket per refill: the head's (the longest waiting), so no row is
            # padded past its own bucket; the next bucket's rows come in the next refill
            prompt_len = self.buckets.prompt_bucket(self._lens[self.waiting[0]])
            n = 0
            while (
                n < min(len(free), len(self.waiting))
                and self.buckets.prompt_bucket(self._lens[self.waiting[n]]) == prompt_len
            ):
                n += 1
            indices = tuple(self.waiting.popleft() for _ in range(n))
            slots = tuple(free[:n])
            for i, slot in zip(indices, slots, strict=True):
                self.status[i] = SeqStatus.RUNNING
                self.running[slot] = i
            batch = self.buckets.padded_batch(n, self.shape.slots)
            return Step(Action.REFILL, Refill(slots, indices, prompt_len, batch))
        if self.running:
            return Step(Action.DECODE)
        return Step(Action.DONE)

    def finish(self, slot: int) -> int:
        """Row in `slot` finished: free the slot; returns its request's index."""
        if slot not in self.running:
            raise RuntimeError(f"slot {slot} finished but holds no running request")
        i = self.running.pop(slot)
        self.status[i] = SeqStatus.FINISHED
        return i
