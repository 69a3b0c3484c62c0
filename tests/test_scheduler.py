"""The scheduler and the plain-data request types: no torch, no model.

As in vLLM's scheduler tests, the runner is replaced by hand-made outputs: `FakeModel`
gives a fixed token for each (request, position), so a sequence recomputed after
preemption must come out exactly as it would have without it. Every plan is checked
against the invariants (budgets, block tables, reference counts), and seeded random
workloads check that every request finishes exactly once with its own tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from batchgen.engine.block_pool import NULL_BLOCK, BlockPool
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import (
    Completion,
    FinishReason,
    Request,
    SamplingParams,
    Scheduled,
    ScoredChunk,
    SeqState,
    SeqStatus,
    StepPlan,
)

EOS = 1
W, R, F = SeqStatus.WAITING, SeqStatus.RUNNING, SeqStatus.FINISHED


@dataclass
class FakeModel:
    """The token a request gets at each position: a pure function, so recomputing a
    sequence reproduces it. eos_at[i] = k: request i's k-th generated token is EOS."""

    eos_at: dict[int, int] = field(default_factory=dict)

    def token(self, seq: SeqState) -> int:
        i, pos = seq.request.index, seq.num_tokens
        if self.eos_at.get(i) == seq.num_generated:
            return EOS
        return 2 + (i * 7919 + pos * 104729) % 97

    def expected(self, r: Request) -> list[int]:
        """What request r must come out with: up to max_new_tokens, or to its EOS."""
        seq = SeqState(r, 0)
        while seq.num_generated < r.params.max_new_tokens:
            tok = self.token(seq)
            seq.token_ids.append(tok)
            if tok == EOS and not r.params.ignore_eos:
                break
        return seq.output_ids


def _scored(s: Scheduled) -> range:
    """The positions of a scored candidate's chunk whose logits score a token."""
    lo = max(s.start, s.seq.request.score_from - 1)
    return range(lo, min(s.start + s.num_tokens, s.seq.num_tokens - 1))


class Harness:
    """Drives a scheduler with fake outputs, checking every plan and every transition."""

    def __init__(self, sched: Scheduler, model: FakeModel | None = None) -> None:
        self.sched, self.model = sched, model or FakeModel()
        self.plans: list[StepPlan] = []
        self.finished: list[SeqState] = []
        self.status: dict[SeqState, SeqStatus] = {}

    def add(self, r: Request) -> SeqState:
        seq = self.sched.add(r)
        assert seq.status is W and seq.num_computed == 0 and seq.block_table == []
        self.status[seq] = W
        return seq

    def step(self) -> StepPlan:
        sched = self.sched
        running_before = list(sched.running)
        plan = sched.schedule()
        self.plans.append(plan)
        check_plan(sched, plan, running_before)
        self._transitions()
        sampled = [(self.model.token(s.seq), -0.5) for s in plan.scheduled if s.samples]
        scored = [
            ScoredChunk([-0.25] * len(_scored(s))) for s in plan.prefills if s.seq.request.scoring
        ]
        done = sched.update(plan, sampled, scored)
        for seq in done:
            assert seq.status is F and seq.block_table == []
            assert seq not in self.finished, "a sequence finished twice"
        self.finished += done
        for seq in sched.running:  # what is still running has a token left to compute
            assert seq.num_uncomputed >= 1
        self._transitions()
        check_pool(sched)
        return plan

    def _transitions(self) -> None:
        for seq, old in self.status.items():
            new = seq.status
            assert new is old or (old, new) in {(W, R), (R, W), (R, F)}, (old, new)
            self.status[seq] = new

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished:
            plan = self.step()
            assert not plan.is_empty, "an empty plan with work waiting"
            assert len(self.plans) < max_steps

    def output(self, index: int) -> list[int]:
        (seq,) = [s for s in self.finished if s.request.index == index]
        return seq.output_ids


def check_plan(sched: Scheduler, plan: StepPlan, running_before: list[SeqState]) -> None:
    bs = sched.block_size
    assert plan.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert plan.scheduled == plan.decodes + plan.prefills
    seqs = [s.seq for s in plan.scheduled]
    assert len(set(seqs)) == len(seqs), "a sequence scheduled twice in one step"
    assert set(seqs) <= set(sched.running)
    for s in plan.scheduled:
        seq = s.seq
        assert seq.status is R
        assert s.start == seq.num_computed and 1 <= s.num_tokens <= seq.num_uncomputed
        ends = s.start + s.num_tokens == seq.num_tokens
        assert s.samples == (ends and not seq.request.scoring)  # a scored candidate never samples
        # the table holds exactly the blocks of the tokens computed by the end of the step
        assert len(seq.block_table) == -(-(s.start + s.num_tokens) // bs)
    assert all(s.num_tokens == 1 and s.samples for s in plan.decodes)
    # only the last prefill may stop short of its sequence's end (a chunk cut by the budget)
    assert all(s.start + s.num_tokens == s.seq.num_tokens for s in plan.prefills[:-1])
    for seq in plan.preempted:
        assert seq.status is W and seq.block_table == [] and seq.num_computed == 0
        assert seq not in sched.running and seq.num_preemptions >= 1
    if plan.preempted:
        assert plan.admitted == []  # a step that preempts admits nothing
    assert all(seq.num_preemptions == 0 and seq not in running_before for seq in plan.admitted)
    # decodes are never starved: with a budget of at least one token per sequence, every
    # running sequence that was not preempted runs in the step
    if sched.max_num_batched_tokens >= sched.max_num_seqs:
        assert set(running_before) - set(plan.preempted) <= set(seqs)


def check_pool(sched: Scheduler) -> None:
    """Reference counts are the number of block tables holding a block; the pool is never
    over-allocated; only running sequences hold blocks."""
    pool = sched.pool
    holders = Counter(b for seq in sched.running for b in seq.block_table)
    for seq in sched.running:
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert NULL_BLOCK not in seq.block_table
    assert all(seq.block_table == [] for _, seq in sched.waiting)
    assert len(holders) <= pool.num_usable
    assert [pool.ref_count[b] for b in range(pool.num_blocks)] == [
        holders.get(b, 0) for b in range(pool.num_blocks)
    ]
    assert set(pool.free) == {b for b in range(1, pool.num_blocks) if not holders.get(b)}
    # a block waited for is one its running sequence computes and has not cached yet
    for key, seq in sched.pending.items():
        assert seq.status is R and not pool.is_cached(key)
        assert key in seq.block_keys[seq.num_registered :]


def _sched(num_blocks=17, block_size=4, max_num_seqs=4, budget=64, caching=True) -> Scheduler:
    pool = BlockPool(num_blocks, block_size, prefix_caching=caching)
    return Scheduler(pool, max_num_seqs, budget, eos_ids=(EOS,))


def _req(i: int, n: int, max_new: int = 4, **kw) -> Request:
    return Request(
        i, [10 + 100 * i + t for t in range(n)], SamplingParams(max_new_tokens=max_new, **kw)
    )


# --------------------------------------------------------------------------- lifecycle


def test_lifecycle_waiting_running_finished():
    sched = _sched(num_blocks=9)
    seq = sched.add(Request(0, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=3)))
    assert seq.status is W and sched.num_waiting == 1 and sched.has_unfinished

    plan = sched.schedule()
    assert plan.admitted == [seq] and plan.decodes == []
    assert plan.prefills == [Scheduled(seq, 0, 5, True)]
    assert seq.status is R and sched.running == [seq] and sched.num_waiting == 0
    assert len(seq.block_table) == 2
    assert sched.update(plan, [(20, -0.5)]) == []
    assert (seq.output_ids, seq.num_computed, seq.logprobs) == ([20], 5, [-0.5])

    plan = sched.schedule()
    assert plan.decodes == [Scheduled(seq, 5, 1, True)] and plan.admitted == []
    assert sched.update(plan, [(21, -0.25)]) == []
    plan = sched.schedule()
    assert sched.update(plan, [(22, -1.0)]) == [seq]
    assert seq.status is F and seq.finish_reason is FinishReason.LENGTH
    assert seq.output_ids == [20, 21, 22] and seq.logprobs == [-0.5, -0.25, -1.0]
    assert seq.block_table == [] and sched.pool.num_free == sched.pool.num_usable
    assert not sched.has_unfinished and sched.schedule().is_empty
    with pytest.raises(RuntimeError, match="finished while finished"):
        sched.finish(seq, FinishReason.STOP)


def test_eos_stops_a_row_unless_it_ignores_eos():
    sched = _sched()
    h = Harness(sched, FakeModel(eos_at={0: 1, 1: 1}))
    stops, ignores = h.add(_req(0, 3, max_new=5)), h.add(_req(1, 3, max_new=5, ignore_eos=True))
    h.run()
    assert stops.finish_reason is FinishReason.STOP and len(stops.output_ids) == 2
    assert stops.output_ids[-1] == EOS  # the EOS token is kept
    assert ignores.finish_reason is FinishReason.LENGTH and len(ignores.output_ids) == 5
    assert ignores.output_ids[1] == EOS


def test_finish_of_a_waiting_sequence_and_wrong_token_counts_raise():
    sched = _sched()
    a, b = sched.add(_req(0, 3)), sched.add(_req(1, 2))
    sched.max_num_seqs = 1
    plan = sched.schedule()
    assert plan.admitted == [a]
    with pytest.raises(RuntimeError, match="finished while waiting"):
        sched.finish(b, FinishReason.STOP)
    with pytest.raises(ValueError, match="2 sampled tokens for 1 sequences"):
        sched.update(plan, [(5, 0.0), (6, 0.0)])
    # a stop string ends a running sequence early, keeping some of its tokens
    sched.update(plan, [(5, 0.0)])
    sched.finish(a, FinishReason.STOP, keep=0)
    assert (a.status, a.keep, a.block_table) == (F, 0, [])


def test_a_request_larger_than_the_pool_is_refused():
    sched = _sched(num_blocks=3)  # 2 usable blocks: 8 tokens
    assert sched.capacity_tokens == 8
    assert sched.fits(_req(0, 4, max_new=4)) and not sched.fits(_req(0, 5, max_new=4))
    with pytest.raises(ValueError, match="needs 9 cache slots; the pool holds 8"):
        sched.add(_req(0, 5, max_new=4))
    assert not sched.has_unfinished
    with pytest.raises(ValueError):
        Scheduler(BlockPool(4, 4), 0, 16)


def test_longest_waiting_prompt_is_admitted_first_within_max_num_seqs():
    sched = _sched(max_num_seqs=2)
    h = Harness(sched)
    for i, n in enumerate([3, 9, 5, 9]):
        h.add(_req(i, n, max_new=2))
    first = h.step()
    assert [s.request.index for s in first.admitted] == [1, 3]  # ties: arrival order
    assert len(sched.running) == 2 and sched.num_waiting == 2
    h.run()
    admitted = [s.request.index for p in h.plans for s in p.admitted]
    assert admitted == [1, 3, 2, 0]
    assert sorted(s.request.index for s in h.finished) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- budget


def test_chunked_prefill_of_a_prompt_longer_than_the_budget():
    sched = _sched(budget=4)
    h = Harness(sched)
    seq = h.add(_req(0, 10, max_new=2))
    waiting = h.add(_req(1, 2, max_new=2))
    chunks = [h.step().prefills for _ in range(3)]
    assert chunks[0] == [Scheduled(seq, 0, 4, False)]
    assert chunks[1] == [Scheduled(seq, 4, 4, False)]
    # the last chunk samples; the budget left (2) admits the short request
    assert chunks[2] == [Scheduled(seq, 8, 2, True), Scheduled(waiting, 0, 2, True)]
    assert h.plans[0].num_sampled == 0 and h.plans[2].num_sampled == 2
    # a chunk's full blocks are cached as soon as they are computed
    assert sched.pool.key[seq.block_table[0]] is not None
    h.run()
    assert h.output(0) == h.model.expected(_req(0, 10, max_new=2))


def test_decodes_come_before_prefills_and_admissions():
    sched = _sched(budget=3)
    h = Harness(sched)
    a, b = h.add(_req(0, 2, max_new=9)), h.add(_req(1, 1, max_new=9))
    h.step()  # both prefilled
    c = h.add(_req(2, 10, max_new=2))
    plan = h.step()
    assert plan.decodes == [Scheduled(a, 2, 1, True), Scheduled(b, 1, 1, True)]
    assert plan.prefills == [Scheduled(c, 0, 1, False)]  # what the budget leaves
    assert plan.scheduled == plan.decodes + plan.prefills
    plan = h.step()  # c, still prefilling, is served after the decodes
    assert [s.seq for s in plan.decodes] == [a, b] and plan.prefills == [Scheduled(c, 1, 1, False)]
    sched.max_num_batched_tokens = 2  # a budget the decodes use up: c waits for its chunk
    plan = h.step()
    assert [s.seq for s in plan.scheduled] == [a, b]
    sched.max_num_batched_tokens = 3
    h.run()
    assert [h.output(i) for i in range(3)] == [
        h.model.expected(r) for r in (_req(0, 2, 9), _req(1, 1, 9), _req(2, 10, 2))
    ]


# --------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_takes_the_newest_and_recomputes_it_later(caching):
    # 4 usable blocks of 4: two rows of 4 + 8 tokens need 3 blocks each at the end
    sched = _sched(num_blocks=5, caching=caching)
    h = Harness(sched)
    ra, rb = _req(0, 4, max_new=8), _req(1, 4, max_new=8)
    a, b = h.add(ra), h.add(rb)
    while not h.step().preempted:
        pass
    plan = h.plans[-1]
    assert plan.preempted == [b] and [s.seq for s in plan.decodes] == [a]
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert (b.status, b.num_computed, b.block_table, b.num_registered) == (W, 0, [], 0)
    kept = list(b.output_ids)
    assert len(kept) == 5 and b.token_ids == rb.prompt_ids + kept  # its output is kept
    h.run()
    # recomputed in one prefill of prompt + output, from the first block not in the cache
    redo = [s for p in h.plans for s in p.prefills if s.seq is b][-1]
    assert redo.samples and redo.start + redo.num_tokens == 4 + len(kept)
    assert (redo.start > 0) == caching and redo.start % 4 == 0
    assert b.num_cached_prompt == 0  # only a first admission counts as a prompt cache hit
    assert h.output(0) == h.model.expected(ra) and h.output(1) == h.model.expected(rb)
    assert a.num_preemptions == 0


def test_a_row_that_needs_the_whole_pool_finishes_next_to_others():
    sched = _sched(num_blocks=4, block_size=2, max_num_seqs=4, budget=8)
    h = Harness(sched)
    big = h.add(_req(0, 2, max_new=4))  # 6 tokens: all 3 usable blocks
    for i in range(1, 4):
        h.add(_req(i, 1, max_new=1))
    h.run()
    assert sorted(s.request.index for s in h.finished) == [0, 1, 2, 3]
    assert h.output(0) == h.model.expected(_req(0, 2, max_new=4))
    assert big.finish_reason is FinishReason.LENGTH


# --------------------------------------------------------------------------- prefix cache

PREFIX = list(range(50, 58))  # 2 blocks of 4


def test_a_cached_prefix_is_taken_at_admission():
    sched = _sched()
    pool = sched.pool
    h = Harness(sched)
    a = h.add(Request(0, PREFIX + [60, 61], SamplingParams(max_new_tokens=3)))
    h.step()
    assert (pool.hits, pool.queries) == (0, 2) and a.num_cached_prompt == 0
    assert a.num_registered == 2  # both prefix blocks are in the cache now

    b = h.add(Request(1, PREFIX + [70, 71, 72], SamplingParams(max_new_tokens=3)))
    plan = h.step()
    assert plan.admitted == [b] and plan.prefills == [Scheduled(b, 8, 3, True)]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_prompt == 8 and b.num_computed == 11
    assert (pool.hits, pool.queries) == (2, 4)
    assert [pool.ref_count[x] for x in a.block_table] == [2, 2, 1]
    shared = a.block_table[:2]
    h.step()
    assert a.status is F and [pool.ref_count[x] for x in shared] == [1, 1]
    h.run()
    assert [pool.ref_count[x] for x in shared] == [0, 0]
    # freed, the blocks stay cached: a prompt that is just the prefix takes the first one
    # (the second must be computed: a sequence samples from its own last token)
    c = h.add(Request(2, list(PREFIX), SamplingParams(max_new_tokens=2)))
    plan = h.step()
    assert plan.prefills == [Scheduled(c, 4, 4, True)] and c.block_table[0] == shared[0]
    assert c.num_cached_prompt == 4 and (pool.hits, pool.queries) == (3, 5)
    h.run()


def test_a_prefix_being_computed_is_waited_for_then_hit():
    sched = _sched()
    h = Harness(sched)
    a = h.add(Request(0, PREFIX + [60], SamplingParams(max_new_tokens=4)))
    b = h.add(Request(1, PREFIX + [70], SamplingParams(max_new_tokens=2)))
    c = h.add(_req(2, 5))  # shares nothing: admitted past the waiting b
    plan = h.step()
    assert [s.seq for s in plan.prefills] == [a, c] and b.status is W
    plan = h.step()  # a cached them: b takes them and computes its last token only
    assert plan.admitted == [b] and b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_prompt == 8 and Scheduled(b, 8, 1, True) in plan.prefills
    assert not sched.pending
    h.run()


def test_a_prefix_computed_in_chunks_is_waited_for_to_its_end():
    sched = _sched(budget=4)  # a's first chunk is its first block only
    h = Harness(sched)
    a = h.add(Request(0, PREFIX + [60], SamplingParams(max_new_tokens=2)))
    b = h.add(Request(1, PREFIX + [70], SamplingParams(max_new_tokens=2)))
    plan = h.step()
    assert plan.prefills == [Scheduled(a, 0, 4, False)]
    assert list(sched.pending.values()) == [a] and b.status is W  # block 2 is in the works
    h.step()
    assert b.status is W
    h.run()
    assert b.num_cached_prompt == 8 and not sched.pending


def test_without_prefix_caching_nothing_waits():
    sched = _sched(caching=False)
    h = Harness(sched)
    h.add(Request(0, PREFIX + [60], SamplingParams(max_new_tokens=2)))
    h.add(Request(1, PREFIX + [70], SamplingParams(max_new_tokens=2)))
    plan = h.step()
    assert [s.start for s in plan.prefills] == [0, 0] and not sched.pending
    h.run()


def test_prefix_hits_are_counted_once_per_admission():
    sched = _sched(num_blocks=9)  # 8 usable blocks
    h = Harness(sched)
    h.add(Request(0, PREFIX + [60], SamplingParams(max_new_tokens=1)))
    h.run()  # the prefix is cached
    h.add(_req(1, 24, max_new=4))  # 6 blocks, then 7: request 2 waits for them
    h.add(Request(2, PREFIX + [70], SamplingParams(max_new_tokens=1)))
    h.run()
    assert sched.num_preemptions == 0
    assert sched.pool.hits * 4 == sum(s.num_cached_prompt for s in h.finished)


def test_no_prefix_caching_computes_every_prompt_token():
    sched = _sched(caching=False)
    h = Harness(sched)
    h.add(Request(0, PREFIX + [60], SamplingParams(max_new_tokens=2)))
    h.run()
    h.add(Request(1, PREFIX + [70], SamplingParams(max_new_tokens=2)))
    plan = h.step()
    assert plan.prefills[0].start == 0 and sched.pool.hits == 0 and not sched.pool.cached
    h.run()


# --------------------------------------------------------------------------- random workloads


def _workload(seed: int, reserve_full_rows: bool = False):
    """A random scheduler and requests with random arrival steps, lengths, limits, EOS
    positions and shared prefixes, some of them scored candidates (score_from set); the pool
    is tight enough to preempt in many seeds."""
    rng = random.Random(seed)
    scoring = random.Random(seed + 1000)  # apart, so the other draws stay as they were
    bs = rng.choice([1, 2, 4, 8])
    templates = [[rng.randint(2, 500) for _ in range(rng.randint(1, 24))] for _ in range(3)]
    n = rng.randint(1, 30)
    requests, arrivals, eos_at = [], [], {}
    for i in range(n):
        prefix = rng.choice(templates) if rng.random() < 0.5 else []
        prompt = prefix + [rng.randint(2, 500) for _ in range(rng.randint(1, 24))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.2)
        score_from = (
            scoring.randint(1, len(prompt) - 1)
            if len(prompt) > 1 and scoring.random() < 0.25
            else None
        )
        requests.append(Request(i, prompt, params, score_from=score_from))
        arrivals.append(rng.randint(0, 30))
        if rng.random() < 0.3:
            eos_at[i] = rng.randint(0, 20)
    longest = max(r.max_tokens for r in requests)
    need = -(-longest // bs)
    num_blocks = 1 + rng.randint(need, 3 * need)
    sched = Scheduler(
        BlockPool(num_blocks, bs, prefix_caching=rng.random() < 0.8),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([1, 3, 8, 16, 64]),
        eos_ids=(EOS,),
        reserve_full_rows=reserve_full_rows,
    )
    return sched, requests, arrivals, FakeModel(eos_at)


def _run_workload(seed: int, reserve_full_rows: bool = False) -> Harness:
    sched, requests, arrivals, model = _workload(seed, reserve_full_rows)
    h = Harness(sched, model)
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    step = 0
    while pending or sched.has_unfinished:
        if not sched.has_unfinished:
            step = max(step, pending[0][0])  # idle: jump to the next arrival
        while pending and pending[0][0] <= step:
            h.add(requests[pending.pop(0)[1]])
        plan = h.step()
        assert not plan.is_empty
        step += 1
        assert step < 20_000
    # every request finished exactly once, with its own tokens, and nothing is held
    assert sorted(s.request.index for s in h.finished) == list(range(len(requests)))
    for r in requests:
        (seq,) = [s for s in h.finished if s.request.index == r.index]
        if r.scoring:  # nothing generated; one log-probability per scored token, once
            assert seq.output_ids == [] and seq.finish_reason is FinishReason.STOP
            assert seq.logprobs == [-0.25] * (r.prompt_len - r.score_from)
            continue
        out = h.output(r.index)
        assert out == model.expected(r), f"request {r.index}"
        if seq.finish_reason is FinishReason.LENGTH:
            assert len(out) == r.params.max_new_tokens
        else:
            assert out[-1] == EOS and not r.params.ignore_eos
            assert len(out) <= r.params.max_new_tokens
        assert len(seq.logprobs) == len(out)
    pool = sched.pool
    assert pool.num_free == pool.num_usable and not any(pool.ref_count)
    assert sched.num_preemptions == sum(s.num_preemptions for s in h.finished)
    return h


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_keep_every_invariant(seed):
    _run_workload(seed)


def test_random_workloads_preempt_chunk_and_hit_the_cache():
    """The seeds above exercise what they are meant to: preemption, chunked prefill and
    prefix-cache hits each happen in several of them."""
    preempting = chunking = hitting = scoring = 0
    for seed in range(30):
        h = _run_workload(seed)
        preempting += h.sched.num_preemptions > 0
        chunking += any(
            not s.samples and not s.seq.request.scoring for p in h.plans for s in p.prefills
        )
        hitting += any(s.num_cached_prompt for s in h.finished)
        scoring += any(s.request.scoring and s.num_preemptions for s in h.finished)
    assert preempting >= 5 and chunking >= 5 and hitting >= 5, (preempting, chunking, hitting)
    assert scoring >= 2, scoring  # scored candidates preempted and recomputed


def test_reserving_full_rows_never_preempts_and_still_runs_rows_together():
    """The same workloads with admission reserving every row's full length (the CPU's pool
    sized from the job): every invariant holds, nothing is preempted, and rows still share
    the pool (more than one running at once in most seeds)."""
    together = 0
    for seed in range(30):
        h = _run_workload(seed, reserve_full_rows=True)
        assert h.sched.num_preemptions == 0, seed
        together += max(len(p.scheduled) for p in h.plans) > 1
    assert together >= 15, together  # 19 of the 30 seeds


def test_reserving_full_rows_admits_what_fits_at_full_length():
    # 4-token blocks, 12 usable: rows of 8 prompt + 8 new tokens take 4 blocks at full length
    sched = _sched(num_blocks=13, max_num_seqs=8)
    sched.reserve_full_rows = True
    for i in range(5):
        sched.add(_req(i, 8, max_new=8))
    plan = sched.schedule()
    assert len(plan.admitted) == 3  # 3 x 4 blocks; the optimistic rule admits 5 (2 blocks each)
    optimistic = _sched(num_blocks=13, max_num_seqs=8)
    for i in range(5):
        optimistic.add(_req(i, 8, max_new=8))
    assert len(optimistic.schedule().admitted) == 5


# --------------------------------------------------------------------------- plain data


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=0),
        dict(temperature=-0.1),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(seed=-1),
        dict(seed=2**31),
    ],
)
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_plain_data_properties():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy
    assert Request(0, [5, 6, 7]).prompt_len == 3
    c = Completion(index=0, token_ids=[1, 2], finish_reason=FinishReason.LENGTH, prompt_tokens=3)
    assert c.completion_tokens == 2 and c.cached_tokens == 0 and c.error is None
    assert FinishReason("stop") is FinishReason.STOP
    seq = SeqState(Request(0, [5, 6, 7]), arrival=0)
    assert (seq.num_tokens, seq.num_generated, seq.num_uncomputed) == (3, 0, 3)
    seq.token_ids.append(9)
    assert seq.output_ids == [9] and seq.num_generated == 1


def test_engine_config_validation_and_pool_sizing():
    from batchgen.engine.config import CPU_POOL_ROWS, EngineConfig
    from batchgen.engine.kv_sizing import pool_blocks

    for bad in (
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=0),
        dict(block_size=0),
        dict(kv_cache_tokens=31),
        dict(gpu_memory_utilization=0.0),
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    cfg = EngineConfig(max_num_seqs=4, block_size=16)
    assert pool_blocks(cfg, longest_row=40, budget_bytes=None, bytes_per_block=1) == 1 + 4 * 3
    # more sequences than CPU_POOL_ROWS share a pool of that many longest rows
    assert EngineConfig().max_num_seqs == 256 > CPU_POOL_ROWS == 64
    assert pool_blocks(EngineConfig(), 40, None, 1) == 1 + CPU_POOL_ROWS * 3
    assert pool_blocks(EngineConfig(max_num_seqs=65), 40, None, 1) == 1 + 64 * 3
    assert pool_blocks(EngineConfig(kv_cache_tokens=100), 40, None, 1) == 7  # the flag wins
    assert pool_blocks(cfg, 40, budget_bytes=1000, bytes_per_block=10) == 100  # the budget
    # the attention kernel's bound (flex's int32 indexing) caps every way of sizing it
    assert pool_blocks(cfg, 40, budget_bytes=1000, bytes_per_block=10, max_blocks=50) == 50
    assert pool_blocks(EngineConfig(kv_cache_tokens=100), 40, None, 1, max_blocks=3) == 3
    assert pool_blocks(cfg, 40, None, 1, max_blocks=100) == 1 + 4 * 3
    gpu = EngineConfig.for_device("cuda", max_num_seqs=None, block_size=8)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.block_size) == (256, 8192, 8)
    assert EngineConfig.for_device("cpu") == EngineConfig()
    # a compiled CPU decode pads every row to the longest table: 64 sequences there
    assert EngineConfig.for_device("cpu", compiled=True).max_num_seqs == CPU_POOL_ROWS
    assert EngineConfig.for_device("cpu", compiled=True, max_num_seqs=8).max_num_seqs == 8
    assert EngineConfig.for_device("cuda", compiled=True).max_num_seqs == 256


def test_a_scored_candidate_computes_from_the_token_before_its_first_scored_one():
    sched = _sched()
    h = Harness(sched)
    h.add(Request(0, PREFIX + [60], SamplingParams(max_new_tokens=1)))
    h.run()  # both prefix blocks are cached
    # scored from position 8: its logits come from position 7, in the second prefix block
    c = h.add(Request(1, PREFIX + [61, 62], score_from=8))
    plan = h.step()
    assert plan.prefills == [Scheduled(c, 4, 6, False)] and plan.decodes == []
    assert c.num_cached_prompt == 4
    assert c.status is F and c.logprobs == [-0.25, -0.25] and c.output_ids == []
    # a request scored from a block boundary + 1 takes the whole prefix
    d = h.add(Request(2, PREFIX + [61, 62], score_from=9))
    plan = h.step()
    assert plan.prefills == [Scheduled(d, 8, 2, False)] and d.logprobs == [-0.25]


def test_a_request_as_large_as_the_pool_is_admitted_when_alone():
    # 4 usable blocks; the 16-token prompt needs all of them at once (no watermark left)
    sched = _sched(num_blocks=5, max_num_seqs=2)
    h = Harness(sched)
    a = h.add(_req(0, 15, max_new=1))
    h.add(_req(1, 2, max_new=1))
    plan = h.step()
    assert plan.admitted == [a] and plan.prefills[0].num_tokens == 15  # 4 blocks
    h.run()
    assert len(h.finished) == 2
