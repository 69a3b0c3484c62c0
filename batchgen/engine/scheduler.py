"""The static-bucket scheduler: plain Python, no torch.

It owns the lifecycle of every request of one planning window: WAITING until its batch
is handed out, RUNNING while the runner has it, FINISHED once its completion is back.
Batches come out in the planner's order (longest bucket first).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from batchgen.engine.sequence import Request
from batchgen.planner import BatchPlan, BucketConfig, Plan, plan_batches


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class StaticScheduler:
    def __init__(self, requests: Sequence[Request], buckets: BucketConfig) -> None:
        self.requests = list(requests)
        self.plan: Plan = plan_batches(
            [r.prompt_len for r in self.requests],
            [r.params.max_new_tokens for r in self.requests],
            buckets,
        )
        self.status = [SeqStatus.WAITING] * len(self.requests)
        self._next = 0

    @property
    def num_finished(self) -> int:
        return sum(s is SeqStatus.FINISHED for s in self.status)

    @property
    def is_done(self) -> bool:
        return self.num_finished == len(self.requests)

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
