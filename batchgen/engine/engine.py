"""The engine loop: the scheduler plans a step, the runner computes it, the scheduler
takes the sampled tokens; finished sequences come back as completions with their text.

Requests arrive as one stream. The engine keeps up to `read_ahead` of them waiting (the
scheduler admits the longest first), pulling more from the stream as sequences are
admitted, so nothing drains at a window boundary and a 10-million-row input is never held.
The KV pool is sized and allocated at the first request (engine/config.py) and kept, with
its prefix cache, across calls.
Every step's accounting comes back as a value (`StepReport`) for the caller to sum.

A scored request (`Request.candidates`, the score task) runs as one sequence per candidate,
prompt + candidate; the scheduler has the first compute the prompt and the others hit its
blocks. The request completes, with each candidate's log-probability, when all have.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from batchgen.engine.block_pool import BlockPool
from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import Constrainer, ConstraintError, Grammars
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import (
    Completion,
    FinishReason,
    KVPool,
    Request,
    Sequence,
    StepPlan,
    StepReport,
)
from batchgen.engine.stopping import Detokenize, tokens_to_keep, trim_at_stop


@dataclass(slots=True)
class _ScoredRow:
    """A scored request in flight: its candidates' log-probabilities as they finish."""

    request: Request
    scores: list[float | None]
    cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return all(x is not None for x in self.scores)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        detokenize: Detokenize,
        eos_ids: Seq[int] = (),
        grammars: Grammars | None = None,
    ) -> None:
        self.runner, self.config, self.detokenize = runner, config, detokenize
        self.eos_ids = tuple(eos_ids)
        self.grammars = grammars  # None: constrained requests are refused
        self.constrainer = Constrainer(grammars) if grammars is not None else None
        self.scheduler: Scheduler | None = None  # made with the pool, at the first request
        self.kv_pool: KVPool | None = None  # the KV cache as allocated, at the first request
        self._candidates: dict[Sequence, tuple[_ScoredRow, int]] = {}  # seq -> (row, which)

    def _start(self, first: list[Request]) -> Scheduler:
        """Size and allocate the KV pool (from the first requests on the CPU), once."""
        longest = max((p.max_tokens for r in first for p in self._expand(r)), default=1)
        longest = min(longest, self.runner.max_positions)
        free = self.runner.free_device_bytes()
        blocks = self.config.pool_blocks(longest, free, self.runner.kv_bytes_per_block())
        self.runner.allocate(blocks)
        bs = self.config.block_size
        self.kv_pool = KVPool(blocks, bs, blocks * self.runner.kv_bytes_per_block())
        pool = BlockPool(blocks, bs, self.config.prefix_caching)
        return Scheduler(
            pool, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.eos_ids
        )

    # no_grad, not inference_mode: quanto's int4 weights refuse inference tensors.
    @torch.no_grad()  # (a generator: the mode holds across its yields)
    def generate(self, requests: Iterable[Request]) -> Iterator[StepReport]:
        """Run every request once; yield each step's report as sequences finish. A request
        that cannot run (longer than the model's positions or the whole pool) comes back
        at once as an error completion."""
        stream = iter(requests)
        if self.scheduler is None:  # the pool is sized from the first read-ahead
            ahead = list(itertools.islice(stream, self.config.read_ahead))
            self.scheduler = self._start(ahead)
            stream = itertools.chain(ahead, stream)
        sched = self.scheduler
        exhausted = False
        while True:
            rejected = []
            while not exhausted and sched.num_waiting < self.config.read_ahead:
                r = next(stream, None)
                if r is None:
                    exhausted = True
                elif (c := self._add(r)) is not None:
                    rejected.append(c)
            if rejected:
                yield StepReport(finished=rejected)
            if not sched.has_unfinished:
                return
            plan = sched.schedule()
            if plan.is_empty:  # cannot happen: every request fits the pool alone
                raise RuntimeError("the scheduler planned an empty step with work waiting")
            yield self._step(plan)

    @staticmethod
    def _expand(r: Request) -> list[Request]:
        """The sequences r runs as: itself, or one per candidate of a scored request."""
        if not r.candidates:
            return [r]
        n = r.prompt_len
        return [
            replace(r, prompt_ids=r.prompt_ids + list(c), candidates=(), score_from=n)
            for c in r.candidates
        ]

    def _add(self, r: Request) -> Completion | None:
        """Queue r, or return its error completion if it cannot run."""
        parts = self._expand(r)
        error = self._size_error(
            r, max(parts, key=lambda c: c.max_tokens)
        ) or self._check_constraint(r)
        if error is not None:
            return Completion(r.index, [], FinishReason.ERROR, r.prompt_len, error=error)
        if not r.candidates:
            self.scheduler.add(r)
            return None
        row = _ScoredRow(r, [None] * len(parts))
        for j, part in enumerate(parts):
            self._candidates[self.scheduler.add(part)] = (row, j)
        return None

    def _size_error(self, r: Request, longest: Request) -> str | None:
        """Why r cannot run (longest: its longest sequence), or None."""
        limit = self.runner.max_positions
        if longest.max_tokens > limit:
            why = f"exceeds the model's {limit} positions"
        elif not self.scheduler.fits(longest):
            why = f"exceeds the KV cache's {self.scheduler.capacity_tokens} tokens; raise --kv-cache-tokens"
        else:
            return None
        if r.candidates:
            return f"prompt ({r.prompt_len} tokens) + its longest candidate ({longest.prompt_len - r.prompt_len}) {why}"
        return f"prompt ({r.prompt_len} tokens) + max_new_tokens ({r.params.max_new_tokens}) {why}"

    def _check_constraint(self, r: Request) -> str | None:
        if r.params.constraint is None:
            return None
        if self.grammars is None:
            return "this engine was built without grammars; constrained outputs are off"
        try:
            self.grammars.compile(r.params.constraint)
        except ConstraintError as e:
            return str(e)
        return None

    def _step(self, plan: StepPlan) -> StepReport:
        sched, constrainer = self.scheduler, self.constrainer
        bitmask = constrainer.bitmask(plan, self.runner.device) if constrainer else None
        sampled, scored, timing = self.runner.execute(plan, bitmask)
        finished = sched.update(plan, sampled, scored)
        if bitmask is not None:  # grammars take the new tokens; one that accepted EOS ends
            live = [s.seq for s in plan.scheduled if s.samples and s.seq not in finished]
            ended, refused = constrainer.accept(live)
            for seq in ended:
                sched.finish(seq, FinishReason.STOP)
                finished.append(seq)
            for seq in refused:  # that row fails; the job goes on
                seq.error = (
                    f"the grammar library refused token {seq.token_ids[-1]}, which its own mask "
                    "allowed (a grammar library bug); rerun the row with another seed"
                )
                sched.finish(seq, FinishReason.ERROR)
                finished.append(seq)
        for s in plan.scheduled:  # stop strings: on the host, for the rows that have them
            seq = s.seq
            if s.samples and seq.params.stop and seq not in finished:
                keep = tokens_to_keep(seq.output_ids, seq.params.stop, self.detokenize)
                if keep is not None:
                    sched.finish(seq, FinishReason.STOP, keep)
                    finished.append(seq)
        if constrainer is not None:
            for seq in finished:
                constrainer.release(seq)
        return StepReport(
            finished=[c for seq in finished if (c := self._completion(seq)) is not None],
            prompt_tokens=sum(s.num_tokens for s in plan.prefills),
            cached_tokens=sum(seq.num_cached_prompt for seq in plan.admitted),
            decode_rows=len(plan.decodes),
            padded_rows=timing.padded_rows,
            preempted=len(plan.preempted),
            seconds=timing.seconds,
            compile_seconds=timing.compile_seconds,
            prefill=bool(plan.prefills),
            cache_lookups=plan.cache_lookups,
            cache_hits=plan.cache_hits,
            new_shape=timing.new_shape,
            collective_seconds=timing.collective_seconds,
        )

    def _completion(self, seq: Sequence) -> Completion | None:
        """seq's completion; for a scored candidate, its row's once every candidate is in."""
        if seq.request.scoring:
            return self._scored_completion(seq)
        if seq.finish_reason is FinishReason.ERROR:
            return Completion(
                seq.request.index, [], FinishReason.ERROR, seq.prompt_len, error=seq.error
            )
        ids, logprobs, top = seq.output_ids, seq.logprobs, seq.top_logprobs
        if seq.keep is not None:
            ids, logprobs, top = ids[: seq.keep], logprobs[: seq.keep], top[: seq.keep]
        text = self.detokenize(ids)
        if seq.params.stop and seq.finish_reason is FinishReason.STOP:
            text = trim_at_stop(text, seq.params.stop)
        return Completion(
            index=seq.request.index,
            token_ids=ids,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.prompt_len,
            text=text,
            logprobs=logprobs,
            cached_tokens=seq.num_cached_prompt,
            top_logprobs=top if seq.params.top_logprobs else None,
        )

    def _scored_completion(self, seq: Sequence) -> Completion | None:
        row, j = self._candidates.pop(seq)
        row.scores[j] = sum(seq.logprobs)
        row.cached_tokens += seq.num_cached_prompt
        if not row.done:
            return None
        r = row.request
        return Completion(
            index=r.index,
            token_ids=[],
            finish_reason=FinishReason.STOP,
            prompt_tokens=r.prompt_len,
            cached_tokens=row.cached_tokens,
            scores=row.scores,
        )
