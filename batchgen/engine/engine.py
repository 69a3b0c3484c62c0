"""The engine loop: the scheduler plans a step, the runner computes it, the scheduler
takes the sampled tokens; finished sequences come back as completions with their text.

Requests arrive as one stream. The engine keeps up to `read_ahead` of them waiting (the
scheduler admits the longest first), pulling more from the stream as sequences are
admitted, so nothing drains at a window boundary and a 10-million-row input is never held.
The KV pool is sized and allocated at the first request (engine/config.py) and kept, with
its prefix cache, across calls. On the CPU it is sized from the longest row: of the whole job
when the caller knows it (`reserve`), else of the first read-ahead.
Every step's accounting comes back as a value (`StepReport`) for the caller to sum.
Finished sequences become completions in engine/completions.py (text, constraint verdicts,
the score task's one completion per request).
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
from batchgen.engine.stopping import Detokenize, matched_stop, skipped, tokens_to_keep
from batchgen.model.config import LongRopeRows
from batchgen.model.memory import check_allocation


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
        self.scheduler: Scheduler | None = None  # made with the pool, at the first request
        self.kv_pool: KVPool | None = None  # the KV cache as allocated, at the first request
        self.completions = Completions(detokenize, self.constrainer)
        self._window = runner.model.cfg.sliding_window  # attention's reach, for step_cost
        self.job_longest = 0  # the caller's whole job's longest row (CPU pool sizing), if known

    def reserve(self, longest: int) -> None:
        """Size the pool (when it is sized from the job: on the CPU without kv_cache_tokens)
        for rows of `longest` tokens, not only the first read-ahead's; before the first run."""
        self.job_longest = max(self.job_longest, longest)

    def _start(self, first: list[Request]) -> tuple[Scheduler, WarmUp]:
        """Size and allocate the KV pool (on the CPU from the job's longest row, given to
        `reserve`, or the first requests), and warm up, once. On a GPU without
        --kv-cache-tokens, vLLM's order: the warm-up runs on a pool of two blocks, then the
        pool takes what it left of gpu_memory_utilization x memory (kv_budget_bytes)."""
        cfg, runner = self.config, self.runner
        longest = max((r.longest_tokens for r in first), default=self.job_longest or 1)
        longest = max(longest, self.job_longest)
        longest = min(longest, runner.max_positions)
        block_bytes = runner.kv_bytes_per_block()
        measured = runner.measures_memory and cfg.kv_cache_tokens is None
        budget = None
        if measured:
            runner.allocate(2)  # the scratch block and one: what the warm-up writes
            warm = runner.warm_up(cfg.max_num_seqs, cfg.max_num_batched_tokens)
            budget = runner.kv_budget_bytes(cfg.gpu_memory_utilization)
        blocks = cfg.pool_blocks(longest, budget, block_bytes, runner.max_pool_blocks())
        # A pool sized from the job (the CPU's) is checked against memory, and holds full rows:
        # admission reserves them.
        sized_from_job = not measured and cfg.kv_cache_tokens is None
        if sized_from_job:
            ranks = self.runner.host_ranks  # tensor-parallel ranks sharing this memory
            check_allocation(
                blocks * block_bytes * ranks,
                f"the KV cache sized from the job ({longest} tokens, its longest row, x "
                f"{self.config.pool_rows} rows"
                + (f", x {ranks} ranks' shares" if ranks > 1 else "")
                + ")",
                "--max-new-tokens or --max-num-seqs, or set --kv-cache-tokens",
                self.runner.device,
            )
        self.runner.allocate(blocks)
        if measured:
            runner.rewarm_attention(cfg.max_num_seqs)
        else:
            warm = runner.warm_up(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        bs = self.config.block_size
        self.kv_pool = KVPool(blocks, bs, blocks * block_bytes)
        pool = BlockPool(blocks, bs, self.config.prefix_caching)
        sched = Scheduler(
            pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.eos_ids, sized_from_job
        )
        return sched, warm

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
        for part in parts:  # a longrope model's long prompts cache other keys (longrope.py)
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
        bitmask = constrainer.bitmask(plan, self.runner.device) if constrainer else None
        sampled, scored, timing = self.runner.execute(plan, bitmask)
        # The runner has read the sampled tokens back (its one host sync): the step has ended.
        now = time.perf_counter()
        for s in plan.scheduled:
            if s.samples and not s.seq.first_token_at:
                s.seq.first_token_at = now
        finished = sched.update(plan, sampled, scored)
        if bitmask is not None:  # grammars take the new tokens; one that accepted EOS ends
            self._judge_constrained(plan, finished)
        for s in plan.scheduled:  # stop strings: on the host, for the rows that have them
            seq = s.seq
            if s.samples and seq.params.stop and seq not in finished and not seq.below_min_tokens:
                skip, stops = skipped(seq.params.min_tokens), seq.params.stop
                keep = tokens_to_keep(seq.output_ids, stops, self.detokenize, skip)
                if keep is not None:
                    text = self.detokenize(seq.output_ids[:keep])
                    after = len(self.detokenize(seq.output_ids[:skip])) if skip else 0
                    sched.finish(seq, FinishReason.STOP, keep, matched_stop(text, stops, after))
                    finished.append(seq)
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
