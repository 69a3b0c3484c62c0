"""The engine loop: scheduler hands out batches, the runner fills them, completions
come back with their text."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from batchgen.engine.model_runner import ModelRunner, RowOutput
from batchgen.engine.scheduler import StaticScheduler
from batchgen.engine.sequence import Completion, FinishReason, Request
from batchgen.engine.stopping import tokens_to_keep, trim_at_stop
from batchgen.planner import BatchPlan, BucketConfig

Decode = Callable[[list[int]], str]


class Engine:
    def __init__(self, runner: ModelRunner, decode: Decode, buckets: BucketConfig) -> None:
        self.runner = runner
        self.decode = decode
        self.buckets = buckets

    def generate(self, requests: Sequence[Request]) -> Iterator[tuple[BatchPlan, list[Completion]]]:
        """Run every request once; yield each finished batch's completions as it ends."""
        limit = self.runner.max_positions
        for r in requests:  # checked before any batch runs
            if r.prompt_len + r.params.max_new_tokens > limit:
                raise ValueError(
                    f"request {r.index}: prompt of {r.prompt_len} tokens + max_new_tokens "
                    f"{r.params.max_new_tokens} exceeds the model's {limit} positions"
                )
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
