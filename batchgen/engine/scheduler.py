"""The scheduler: which tokens of which sequences run in the next step. Plain Python, no torch.

Each step is a plan {sequence: tokens this step} under one token budget
(`max_num_batched_tokens`) and a cap on sequences in flight (`max_num_seqs`):

1. Running sequences first, oldest first. A decoding sequence needs one token; one still
   prefilling needs the rest of its prompt, cut to what is left of the budget (chunked
   prefill). If the block pool cannot hold a sequence's new tokens, the newest running
   sequence is preempted: its blocks go back and it waits again, to be recomputed later
   (its full blocks stay in the prefix cache, so recomputing is often a cache hit).
2. Then waiting sequences are admitted in order while budget, sequence slots and blocks
   allow: longest prompt first (a preempted sequence before any new one), so sequences
   decoding together have similar context lengths and the longest work starts early. On
   admission the longest run of the prompt's full blocks already in the prefix cache is
   taken instead of computed. A sequence is admitted only if, after its blocks, a
   watermark of 1% of the pool stays free for the running sequences' growth; with
   `reserve_full_rows` (the CPU's pool, sized from the job), if it holds every running row
   and this one at full length (prompt + max_new_tokens): none is ever preempted. A waiting
   sequence whose next prompt block is being computed right now by a running one (the same
   prompt, or a shared prefix: samples of one row, candidates of a scored row, a few-shot
   preamble) waits for it, a step or a few, and then hits it instead of computing it twice;
   the sequences behind it are admitted meanwhile.

A scored candidate (the score task: `Request.score_from`) samples nothing: its tokens run
as prefill, the runner hands back the log-probability of each token from `score_from` on,
and the sequence ends once all of them are computed. Its prefix-cache hit stops before
the position that predicts its first scored token, which must run: a prompt-logprobs row
(`params.prompt_logprobs`) is scored from its second token, so it takes no hit (as in vLLM).

The runner hands back one sampled token per sequence whose last known token was computed;
`update` appends them, ends sequences at EOS, a stop token id or max_new_tokens
(engine/stopping.py), gives their blocks back, and caches the blocks that became full.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchgen.engine.block_pool import BlockPool, block_hash
from batchgen.engine.sequence import FinishReason, Request, Scheduled, SeqState, SeqStatus, StepPlan
from batchgen.engine.stopping import token_finish

if TYPE_CHECKING:
    from batchgen.engine.sequence import ScoredChunk


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_ids: Sequence[int] = (),
        reserve_full_rows: bool = False,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.pool, self.block_size = pool, pool.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos = frozenset(eos_ids)
        self.reserve_full_rows = reserve_full_rows
        self.waiting: list[tuple[tuple, SeqState]] = []  # heap by admission order
        self.running: list[SeqState] = []  # admission order: the newest is preempted first
        self._arrivals = 0
        self.num_preemptions = 0
        # Blocks kept free at admission for the running sequences' growth, vLLM's 1%
        # watermark: a preemption costs little (its blocks stay in the prefix cache).
        self.watermark = max(1, pool.num_usable // 100)
        # Prefix keys of full blocks that running sequences are computing and have not cached
        # yet: a waiting sequence needing one waits for it (see _awaits_prefix).
        self.pending: dict[int, SeqState] = {}

    # ---------------------------------------------------------------- queue

    def fits(self, request: Request) -> bool:
        """Could the request run alone in an empty pool?"""
        need = request.max_tokens
        return self.pool.blocks_for(need) <= self.pool.num_usable

    def add(self, request: Request) -> SeqState:
        if not self.fits(request):
            raise ValueError(
                f"request {request.index} needs {request.max_tokens}"
                f" cache slots; the pool holds {self.pool.num_usable * self.block_size}"
            )
        seq = SeqState(request, self._arrivals, eos_ids=self.eos)
        self._arrivals += 1
        self._push(seq)
        return seq

    def _push(self, seq: SeqState) -> None:
        # preempted first (in arrival order), then the longest prompt
        key = (0, seq.arrival) if seq.num_preemptions else (1, -seq.prompt_len, seq.arrival)
        heapq.heappush(self.waiting, (key, seq))

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable * self.block_size

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- planning

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self._add_to_plan(plan, seq, n)
            budget -= n
            i += 1
        deferred = []
        lookups, hits = self.pool.queries, self.pool.hits
        growth = sum(map(self._blocks_to_come, self.running)) if self.reserve_full_rows else 0
        while (
            not plan.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0][1]
            if self._awaits_prefix(seq):
                deferred.append(heapq.heappop(self.waiting))
                continue
            if not self._admit(seq, budget, growth):
                break
            growth += self._blocks_to_come(seq) if self.reserve_full_rows else 0
            heapq.heappop(self.waiting)
            self.running.append(seq)
            if not seq.num_preemptions:
                plan.admitted.append(seq)
            n = min(seq.num_uncomputed, budget)
            self._add_to_plan(plan, seq, n)
            budget -= n
        for item in deferred:
            heapq.heappush(self.waiting, item)
        plan.cache_lookups, plan.cache_hits = self.pool.queries - lookups, self.pool.hits - hits
        return plan

    def _add_to_plan(self, plan: StepPlan, seq: SeqState, n: int) -> None:
        last = seq.num_computed + n == seq.num_tokens
        s = Scheduled(seq, seq.num_computed, n, last and not seq.request.scoring)
        # A decode: one token that samples, of a sequence past its prompt (a 1-token prompt
        # or chunk remainder is prefill, and counted as prompt tokens).
        decode = n == 1 and s.samples and seq.num_computed >= seq.prompt_len
        (plan.decodes if decode else plan.prefills).append(s)

    def _grow(self, seq: SeqState, n: int) -> bool:
        """Give seq the blocks for n more tokens; False if the pool has too few free."""
        if seq.num_computed + n <= len(seq.block_table) * self.block_size:
            return True  # most steps: the blocks it holds have room
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        return True

    def _blocks_to_come(self, seq: SeqState) -> int:
        """Blocks seq may still take before it ends at its full length."""
        return self.pool.blocks_for(seq.request.max_tokens) - len(seq.block_table)

    def _admit(self, seq: SeqState, budget: int, growth: int = 0) -> bool:
        """Take seq's cached prefix and blocks for its first chunk; False (and nothing
        taken) if that would leave fewer free blocks than the watermark while others run
        (reserve_full_rows: than all running rows' growth to full length, and this one's)."""
        keys = self._keys(seq, seq.hittable_blocks(self.block_size))
        hit = self.pool.take_cached(keys)
        n = min(seq.num_tokens - len(hit) * self.block_size, budget)
        need = self.pool.blocks_for(len(hit) * self.block_size + n) - len(hit)
        reserve = self.watermark if self.running else 0  # alone, it may take the whole pool
        if self.reserve_full_rows:
            reserve = growth + self._blocks_to_come(seq) - len(hit) - need  # it holds none yet
        if need + reserve > self.pool.num_free:
            self.pool.release(hit)
            return False
        self.pool.record_lookup(len(keys), len(hit))
        seq.block_table = hit + self.pool.allocate(need)
        seq.num_computed = len(hit) * self.block_size
        seq.num_registered = len(hit)
        if self.pool.prefix_caching:
            for k in (k for k in keys[len(hit) :] if not self.pool.is_cached(k)):
                self.pending.setdefault(k, seq)  # (a later block may outlive an evicted one)
        if not seq.num_preemptions:
            seq.num_cached_prompt = seq.num_computed
        seq.status = SeqStatus.RUNNING
        return True

    def _awaits_prefix(self, seq: SeqState) -> bool:
        """Is the first block of seq's prefix not in the cache one a running sequence is
        computing? Then seq should wait and hit it, not compute it too."""
        if not self.pending:
            return False
        for k in self._keys(seq, seq.hittable_blocks(self.block_size)):
            if not self.pool.is_cached(k):
                return k in self.pending
        return False

    def _forget_pending(self, seq: SeqState) -> None:
        for k in seq.block_keys:
            if self.pending.get(k) is seq:
                del self.pending[k]

    def _keys(self, seq: SeqState, n_blocks: int) -> list[int]:
        """Prefix-cache keys of seq's first n_blocks full blocks (computed once, kept)."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < n_blocks:
            j, parent = len(keys), keys[-1] if keys else seq.request.cache_salt
            keys.append(block_hash(parent, seq.token_ids[j * bs : (j + 1) * bs]))
        return keys[:n_blocks]

    def preempt(self, seq: SeqState) -> None:
        """Stop a running sequence and queue it to recompute (engine.py: a longrope row too)."""
        self.running.remove(seq)
        self._forget_pending(seq)
        self.pool.release(seq.block_table)
        seq.forget_scored()  # its scored tokens run again
        seq.block_table, seq.num_computed, seq.num_registered = [], 0, 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push(seq)

    # ---------------------------------------------------------------- results

    def update(
        self, plan: StepPlan, sampled: Sequence[tuple], scored: Sequence[ScoredChunk] = ()
    ) -> list[SeqState]:
        """Apply a step's results: sampled (token, logprob[, top alternatives or None]) per
        sampling sequence and the scored tokens per scored chunk (`Request.scored`), each in
        plan order. Returns the sequences that finished."""
        samplers = [s for s in plan.scheduled if s.samples]
        if len(samplers) != len(sampled):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(samplers)} sequences")
        scorers = [s.seq for s in plan.prefills if s.seq.request.scored is not None]
        if len(scorers) != len(scored):
            raise ValueError(f"{len(scored)} scored chunks for {len(scorers)} candidates")
        for s in plan.scheduled:
            s.seq.num_computed += s.num_tokens
            self._cache_full_blocks(s.seq)
        finished = []
        for seq, chunk in zip(scorers, scored, strict=True):
            seq.take_scored(chunk)
            if seq.request.scoring and seq.num_computed == seq.num_tokens:
                self.finish(seq, FinishReason.STOP)
                finished.append(seq)
        for s, (tok, logprob, *top) in zip(samplers, sampled, strict=True):
            seq = s.seq
            seq.token_ids.append(tok)
            seq.logprobs.append(logprob)
            if top and top[0] is not None:
                seq.top_logprobs.append(top[0])
            reason, stop_token = token_finish(seq, tok, self.eos)  # EOS, stop id, length
            if reason is not None:
                self.finish(seq, reason, why=stop_token)
                finished.append(seq)
        return finished

    def _cache_full_blocks(self, seq: SeqState) -> None:
        n_full = seq.num_computed // self.block_size
        if n_full > seq.num_registered:
            keys = self._keys(seq, n_full)
            for j in range(seq.num_registered, n_full):
                self.pool.cache(seq.block_table[j], keys[j])
                if self.pending.get(keys[j]) is seq:
                    del self.pending[keys[j]]
            seq.num_registered = n_full

    def finish(self, seq: SeqState, reason: FinishReason, keep: int | None = None, why=None):
        """End a running sequence (keep: generated tokens kept, for a stop string; why: its
        stop_reason, the stop string or stop token id)."""
        if seq.status is not SeqStatus.RUNNING:
            raise RuntimeError(f"request {seq.request.index} finished while {seq.status.value}")
        self.running.remove(seq)
        self._forget_pending(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        seq.keep, seq.stop_reason = keep, why
