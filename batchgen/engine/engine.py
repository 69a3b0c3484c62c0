"""The engine loop: the scheduler plans a step, the runner computes it, the scheduler
takes the sampled tokens; finished sequences come back as completions with their text.

Requests arrive as one stream. The engine keeps up to `read_ahead` of them waiting (the
scheduler admits the longest first), pulling more from the stream as sequences are
admitted, so nothing drains at a window boundary and a 10-million-row input is never held.
The KV pool is sized and allocated at the first request (engine/kv_sizing.py) and kept, with
its prefix cache, across calls.
Every step's accounting comes back as a value (`StepReport`) for the caller to sum.
What the loop asks of others: whether a request can run (engine/admission.py), the pool's size
(engine/kv_sizing.py), the constrained rows' token mask (engine/decode_mask.py, handed to the
runner) and their grammars' verdicts (engine/constraints.py), the rows a stop string ends
(engine/stopping.py). Finished sequences become completions in engine/completions.py (text,
constraint verdicts, the score task's one completion per request).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from batchgen.engine.admission import admission_error
from batchgen.engine.block_pool import BlockPool
from batchgen.engine.completions import Completions, error_completion, expand
from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import (
    INCOMPLETE,
    Constrainer,
    Grammars,
    Verdict,
)
from batchgen.engine.decode_mask import DecodeMask
from batchgen.engine.kv_sizing import PoolSizer
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import (
    Completion,
    FinishReason,
    KVPool,
    Request,
    SeqState,
    SeqStatus,
    StepPlan,
    StepReport,
)
from batchgen.engine.step_cost import context_tokens
from batchgen.engine.step_inputs import WarmUp
from batchgen.engine.stopping import Detokenize, StopStrings
from batchgen.model.config import LongRopeRows


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        detokenize: Detokenize,
        eos_ids: Sequence[int] = (),
        grammars: Grammars | None = None,
    ) -> None:
        self.runner, self.config, self.detokenize = runner, config, detokenize
        self.eos_ids = tuple(eos_ids)
        self.grammars = grammars  # None: constrained requests are refused
        self.constrainer = Constrainer(grammars) if grammars is not None else None
        self.mask = DecodeMask(self.constrainer) if self.constrainer is not None else None
        self.scheduler: Scheduler | None = None  # made with the pool, at the first request
        self.kv_pool: KVPool | None = None  # the KV cache as allocated, at the first request
        self.completions = Completions(detokenize, self.constrainer)
        self.stop_strings = StopStrings(detokenize)
        self._window = runner.model.cfg.sliding_window  # attention's reach, for step_cost
        self.sizer = PoolSizer(config)  # the KV pool's size, at the first request

    def reserve(self, longest: int) -> None:
        """Size the pool (when it is sized from the job: on the CPU without kv_cache_tokens)
        for rows of `longest` tokens, not only the first read-ahead's; before the first run."""
        self.sizer.reserve(longest)

    def _start(self, first: list[Request]) -> tuple[Scheduler, WarmUp]:
        """Size, allocate and warm up the KV pool (engine/kv_sizing.py), once, and make the
        scheduler over it."""
        sized = self.sizer.start(self.runner, first)
        self.kv_pool, cfg = sized.kv_pool, self.config
        pool = BlockPool(sized.kv_pool.num_blocks, cfg.block_size, cfg.prefix_caching)
        sched = Scheduler(
            pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.eos_ids, sized.holds_full_rows
        )
        return sched, sized.warm

    # no_grad, not inference_mode: quanto's int4 weights refuse inference tensors.
    @torch.no_grad()  # (a generator: the mode holds across its yields)
    def generate(self, requests: Iterable[Request]) -> Iterator[StepReport]:
        """Run every request once; yield each step's report as sequences finish. A request
        that cannot run (longer than the model's positions or the whole pool) comes back
        at once as an error completion."""
        stream = iter(requests)
        if self.scheduler is None:  # the pool is sized at the first read-ahead
            ahead = list(itertools.islice(stream, self.config.read_ahead))
            # before any row is queued: the warm-up's costs are not a row's
            self.scheduler, warm = self._start(ahead)
            stream = itertools.chain(ahead, stream)
            yield StepReport(
                compile_seconds=warm.compile_seconds,
                capture_seconds=warm.capture_seconds,
                warmup_seconds=warm.warmup_seconds,
                compile_cache=warm.cache,
                graphs_compiled=warm.graphs_compiled,
                graphs_loaded=warm.graphs_loaded,
                at=time.perf_counter(),
            )
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

    def _add(self, r: Request) -> Completion | None:
        """Queue r, or return its error completion if it cannot run."""
        parts = expand(r)
        rope = self.runner.rope_rows
        # a longrope model's long prompts cache other keys (model/families/longrope.py)
        for part in parts:
            part.cache_salt = 1 if rope is not None and rope.is_long(part.prompt_len) else None
        longest = max(parts, key=lambda c: c.max_tokens)
        error = admission_error(
            r,
            longest,
            self.runner.max_positions,
            self.scheduler,
            self.grammars,
            self.runner.vocab_size,
        )
        if error is not None:
            return error_completion(r, error)
        now = time.perf_counter()  # queue entry: a row's timings count from here
        if not r.candidates:
            self.scheduler.add(r).queued_at = now
            return None
        seqs = [self.scheduler.add(part) for part in parts]
        for seq in seqs:
            seq.queued_at = now
        self.completions.scoring(r, seqs)
        return None

    def _recompute_grown_rows(self, plan: StepPlan, rope: LongRopeRows) -> None:
        """A longrope row that has just grown past the original context runs its every token
        again, on the long factors, as transformers' Phi-3 drops its cache there
        (model/families/longrope.py); from then on its blocks are keyed apart."""
        for s in plan.scheduled:
            seq = s.seq
            if seq.status is SeqStatus.RUNNING and seq.num_tokens == rope.original + 1:
                seq.request.cache_salt = 1
                self.scheduler.preempt(seq)
                seq.block_keys.clear()

    def abort(self) -> None:
        """Drop every request in flight (the caller failed or was interrupted inside
        `generate`): their blocks go back, and no later call returns them."""
        sched = self.scheduler
        if sched is None:
            return
        for seq in sched.running:  # whatever step it was in
            sched.pool.release(seq.block_table)
        sched.running.clear()
        sched.waiting.clear()
        sched.pending.clear()
        self.runner.tables.clear()
        self.completions.clear()
        if self.constrainer is not None:
            self.constrainer.clear()

    def _step(self, plan: StepPlan) -> StepReport:
        sched, constrainer = self.scheduler, self.constrainer
        sampled, scored, timing = self.runner.execute(plan, self.mask)
        # The runner has read the sampled tokens back (its one host sync): the step has ended.
        now = time.perf_counter()
        for s in plan.scheduled:
            if s.samples and not s.seq.first_token_at:
                s.seq.first_token_at = now
        finished = sched.update(plan, sampled, scored)
        if constrainer is not None:  # grammars take the new tokens; one that accepted EOS ends
            self._judge_constrained(plan, finished)
        for hit in self.stop_strings.hits(plan, finished):  # on the host (engine/stopping.py)
            sched.finish(hit.seq, FinishReason.STOP, hit.keep, hit.stop)
            finished.append(hit.seq)
        self.runner.release(finished)
        if constrainer is not None:
            for seq in finished:
                constrainer.release(seq)
        if self.runner.rope_rows is not None:
            self._recompute_grown_rows(plan, self.runner.rope_rows)
        return StepReport(
            finished=self.completions.of(finished, now),
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
            compiled=timing.compiled,
            collective_seconds=timing.collective_seconds,
            host_gap_seconds=timing.host_gap_seconds,
            at=now,
            logits_rows=plan.num_sampled + sum(map(len, scored)),
            sampled=plan.num_sampled,
            context_tokens=context_tokens(plan, self._window),
            waiting=sched.num_waiting,
            kv_blocks_used=sched.pool.num_usable - sched.pool.num_free,
            kv_blocks_free=sched.pool.num_free,
        )

    def _judge_constrained(self, plan: StepPlan, finished: list[SeqState]) -> None:
        """Feed the constrained rows their new tokens: a row whose grammar ended finishes
        `stop`; one that cannot go on (its mask was empty) or whose token the matcher refused
        fails; one cut at max_new_tokens short of a complete match is marked incomplete."""
        sched = self.scheduler
        rows = [s.seq for s in plan.scheduled if s.samples]
        for seq, verdict in self.constrainer.accept(rows).items():
            done = seq in finished
            if verdict is Verdict.ENDED and not done:
                sched.finish(seq, FinishReason.STOP)
                finished.append(seq)
            elif verdict in (Verdict.STUCK, Verdict.REFUSED):  # that row fails; the job goes on
                seq.error = verdict.error(seq)
                if done:  # ended by the scheduler (EOS or length) on that token
                    seq.finish_reason = FinishReason.ERROR
                else:
                    sched.finish(seq, FinishReason.ERROR)
                    finished.append(seq)
            elif seq.finish_reason is FinishReason.LENGTH and verdict is Verdict.GOING:
                seq.error = INCOMPLETE
