"""The engine loop: the scheduler decides, the runner computes, completions come back
with their text. Static: one planned batch at a time. Continuous: refill free slots,
decode a round, report the rows that finished."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from batchgen.engine.model_runner import ModelRunner, RowOutput
from batchgen.engine.scheduler import (
    Action,
    ContinuousScheduler,
    RoundReport,
    Schedule,
    StaticScheduler,
)
from batchgen.engine.sequence import Completion, FinishReason, Request
from batchgen.engine.slot_runner import SlotRunner
from batchgen.engine.stopping import tokens_to_keep, trim_at_stop
from batchgen.planner import BatchPlan, BucketConfig

Decode = Callable[[list[int]], str]


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        decode: Decode,
        buckets: BucketConfig,
        schedule: Schedule = Schedule.STATIC,
        prefix_reuse: bool = False,
    ) -> None:
        self.runner = runner
        self.decode = decode
        self.buckets = buckets
        self.schedule = Schedule(schedule)
        self.prefix_reuse = prefix_reuse  # continuous only: prefill a shared prefix once

    @torch.no_grad()  # (a generator: no_grad holds across its yields)
    def generate(
        self, requests: Sequence[Request]
    ) -> Iterator[tuple[BatchPlan | RoundReport, list[Completion]]]:
        """Run every request once; yield completions as rows finish (static: per batch;
        continuous: per decode round), with the batch or round's prefill accounting."""
        limit = self.runner.max_positions
        for r in requests:  # checked before any batch runs
            if r.prompt_len + r.params.max_new_tokens > limit:
                raise ValueError(
                    f"request {r.index}: prompt of {r.prompt_len} tokens + max_new_tokens "
                    f"{r.params.max_new_tokens} exceeds the model's {limit} positions"
                )
        if self.schedule is Schedule.CONTINUOUS:
            yield from self._continuous(requests)
            return
        scheduler = StaticScheduler(requests, self.buckets)
        while (item := scheduler.next_batch()) is not None:
            batch, reqs = item
            stop_fn = None
            if any(r.params.stop for r in reqs):

                def stop_fn(i: int, ids: list[int], reqs=reqs) -> int | None:
                    return tokens_to_keep(ids, reqs[i].params.stop, self.decode)

            outputs = self.runner.run_batch(reqs, batch, stop_fn)
            scheduler.finish(batch)
            yield batch, [self._completion(r, o) for r, o in zip(reqs, outputs, strict=True)]

    def _continuous(self, requests: Sequence[Request]) -> Iterator[tuple[RoundReport, list[Completion]]]:  # fmt: skip
        if not requests:
            return
        scheduler = ContinuousScheduler(requests, self.buckets, self.prefix_reuse)
        slots = SlotRunner(self.runner, scheduler.shape, all(r.params.greedy for r in requests))
        if scheduler.prefix_len:
            slots.prefill_prefix(requests[0].prompt_ids[: scheduler.prefix_len])
            # every row but the one that pays for it (the prefix's own prefill)
            self.runner.stats.prefix_tokens_saved -= scheduler.prefix_len
        stop_fn = None
        if any(r.params.stop for r in requests):

            def stop_fn(req: Request, ids: list[int]) -> int | None:
                return tokens_to_keep(ids, req.params.stop, self.decode)

        prefilled = scheduler.prefix_len  # the shared prefix's own prefill, if any
        while (step := scheduler.schedule()).action is not Action.DONE:
            if step.action is Action.REFILL:
                slots.refill(step.refill, [requests[i] for i in step.refill.indices])
                prefilled += step.refill.computed_prompt_tokens
                continue
            finished = slots.decode_round(stop_fn)
            if finished:
                done = [(requests[scheduler.finish(slot)], out) for slot, out in finished]
                yield RoundReport(prefilled), [self._completion(r, o) for r, o in done]
                prefilled = 0

    def _completion(self, req: Request, out: RowOutput) -> Completion:
        text = self.decode(out.token_ids)
        if out.finish_reason == FinishReason.STOP and req.params.stop:
            text = trim_at_stop(text, req.params.stop)
        return Completion(
            index=req.index,
            token_ids=out.token_ids,
            finish_reason=out.finish_reason,
            prompt_tokens=req.prompt_len,
            text=text,
            logprobs=out.logprobs,
        )
