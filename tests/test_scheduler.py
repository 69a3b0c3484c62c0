"""Scheduler lifecycles (static and continuous) and the plain-data request types: no
torch, no model; the continuous scheduler is driven by a hand-written fake runner."""

import random

import pytest

from batchgen.engine.scheduler import (
    Action,
    ContinuousScheduler,
    Refill,
    SeqStatus,
    SlotShape,
    StaticScheduler,
    Step,
    shared_prefix_len,
)
from batchgen.engine.sequence import Completion, FinishReason, Request, SamplingParams
from batchgen.planner import BucketConfig

BUCKETS = BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=2)


def _requests(lens: list[int]) -> list[Request]:
    return [Request(i, list(range(2, 2 + n)), SamplingParams(max_new_tokens=8)) for i, n in enumerate(lens)]  # fmt: skip


def test_lifecycle_waiting_running_finished():
    reqs = _requests([3, 30, 4, 20, 2])
    sched = StaticScheduler(reqs, BUCKETS)
    assert sched.status == [SeqStatus.WAITING] * 5
    assert sched.num_finished == 0 and not sched.is_done
    handed_out = []
    while (item := sched.next_batch()) is not None:
        batch, batch_reqs = item
        assert [r.index for r in batch_reqs] == list(batch.indices)
        assert all(sched.status[i] is SeqStatus.RUNNING for i in batch.indices)
        others = set(range(5)) - set(batch.indices)
        assert all(sched.status[i] is not SeqStatus.RUNNING for i in others)
        before = sched.num_finished
        sched.finish(batch)
        assert all(sched.status[i] is SeqStatus.FINISHED for i in batch.indices)
        assert sched.num_finished == before + len(batch.indices)
        handed_out.extend(batch.indices)
    assert sorted(handed_out) == list(range(5))
    assert sched.is_done
    assert sched.next_batch() is None  # stays exhausted


def test_batches_come_out_in_plan_order():
    sched = StaticScheduler(_requests([3, 30, 4, 20, 2]), BUCKETS)
    order = []
    while (item := sched.next_batch()) is not None:
        order.append(item[0])
        sched.finish(item[0])
    assert order == sched.plan.batches
    assert [b.prompt_len for b in order] == sorted((b.prompt_len for b in order), reverse=True)


def test_double_finish_raises():
    sched = StaticScheduler(_requests([3, 4]), BUCKETS)
    batch, _ = sched.next_batch()
    sched.finish(batch)
    with pytest.raises(RuntimeError, match="finished while finished"):
        sched.finish(batch)


def test_finish_before_running_raises():
    sched = StaticScheduler(_requests([3, 30]), BUCKETS)
    first, _ = sched.next_batch()
    second = sched.plan.batches[1]
    with pytest.raises(RuntimeError, match="finished while waiting"):
        sched.finish(second)
    sched.finish(first)
    assert not sched.is_done


def test_no_requests_is_done_at_once():
    sched = StaticScheduler([], BUCKETS)
    assert sched.is_done and sched.next_batch() is None


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
    assert c.completion_tokens == 2
    assert FinishReason("stop") is FinishReason.STOP


# --- ContinuousScheduler ------------------------------------------------------------------


def _mixed(lens: list[int], max_new: list[int]) -> list[Request]:
    return [
        Request(i, list(range(2, 2 + n)), SamplingParams(max_new_tokens=m))
        for i, (n, m) in enumerate(zip(lens, max_new, strict=True))
    ]


def test_continuous_shape_is_the_window_longest_bucket_and_new_bucket():
    reqs = _mixed([3, 30, 4, 20, 2], [8, 40, 3, 1, 16])
    sched = ContinuousScheduler(reqs, BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=4))
    assert sched.shape == SlotShape(slots=4, prompt_len=32, max_new=64)
    assert sched.shape.row_stride == 96 and sched.shape.kv_tokens == 5 * 96
    # a small window gets fewer slots
    few = ContinuousScheduler(reqs[:3], BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=8))
    assert few.shape.slots == 4


def test_continuous_slots_leave_room_for_the_scratch_row():
    reqs = _mixed([30] * 8, [16] * 8)
    # stride 48: 8 slots would need 9 rows (432 tokens); 400 fits 4 slots + scratch
    buckets = BucketConfig(max_prompt_len=32, min_bucket=32, max_batch=8, kv_capacity_tokens=400)
    assert ContinuousScheduler(reqs, buckets).shape.slots == 4
    tiny = BucketConfig(max_prompt_len=32, min_bucket=32, max_batch=8, kv_capacity_tokens=90)
    with pytest.raises(ValueError, match="KV cache tokens"):
        ContinuousScheduler(reqs, tiny)


def _drive(sched: ContinuousScheduler, seed: int) -> list[Step]:
    """Run the scheduler against a fake runner whose rows each finish after a random number
    of rounds; check the invariants at every step; return the steps taken."""
    rng = random.Random(seed)
    rounds_left: dict[int, int] = {}  # slot -> decode rounds until its row finishes
    seen: list[int] = []
    steps: list[Step] = []
    while (step := sched.schedule()).action is not Action.DONE:
        steps.append(step)
        assert len(steps) < 1000
        if step.action is Action.REFILL:
            r = step.refill
            assert len(r.slots) == len(r.indices) > 0
            assert all(s not in rounds_left for s in r.slots)  # only free slots
            assert all(0 <= s < sched.shape.slots for s in r.slots)
            assert r.batch_size >= len(r.indices) and r.batch_size & (r.batch_size - 1) == 0
            assert r.batch_size <= sched.shape.slots
            assert r.prompt_len in sched.buckets.prompt_edges
            assert all(sched.requests[i].prompt_len <= r.prompt_len for i in r.indices)
            edges = sched.buckets.prompt_edges  # no row padded past its own bucket
            assert all(
                r.prompt_len == min(e for e in edges if e >= sched.requests[i].prompt_len)
                for i in r.indices
            )
            assert r.prompt_len <= sched.shape.prompt_len
            for s, i in zip(r.slots, r.indices, strict=True):
                assert sched.status[i] is SeqStatus.RUNNING
                rounds_left[s] = rng.randint(1, 4)
            seen.extend(r.indices)
            continue
        assert rounds_left, "DECODE with no running row"
        for s in list(rounds_left):
            rounds_left[s] -= 1
            if rounds_left[s] == 0:
                del rounds_left[s]
                i = sched.finish(s)
                assert sched.status[i] is SeqStatus.FINISHED
    assert not rounds_left and not sched.running
    assert sorted(seen) == list(range(len(sched.requests)))  # each handed out exactly once
    assert sched.is_done
    return steps


@pytest.mark.parametrize("seed", range(5))
def test_continuous_hands_out_every_request_once(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(1, 40)
    reqs = _mixed([rng.randint(1, 32) for _ in range(n)], [rng.randint(1, 50) for _ in range(n)])
    sched = ContinuousScheduler(reqs, BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=4))
    steps = _drive(sched, seed)
    refills = [s.refill for s in steps if s.action is Action.REFILL]
    assert sum(len(r.indices) for r in refills) == n
    if n > sched.shape.slots:
        assert len(refills) > 1  # slots were refilled
    assert sched.schedule() == Step(Action.DONE)  # stays done


def test_continuous_refills_longest_prompts_first_into_free_slots():
    reqs = _mixed([3, 30, 4, 20, 2, 9], [8] * 6)
    sched = ContinuousScheduler(reqs, BucketConfig(max_prompt_len=32, min_bucket=4, max_batch=4))
    # one length bucket per refill: 30 and 20 tokens (32), then 9 (16), then 4 (4)
    assert sched.schedule() == Step(Action.REFILL, Refill((0, 1), (1, 3), 32, 2))
    assert sched.schedule() == Step(Action.REFILL, Refill((2,), (5,), 16, 1))
    assert sched.schedule() == Step(Action.REFILL, Refill((3,), (2,), 4, 1))
    assert sched.schedule() == Step(Action.DECODE)  # no free slot
    assert sched.finish(2) == 5 and sched.finish(0) == 1
    assert sched.schedule() == Step(Action.REFILL, Refill((0, 2), (0, 4), 4, 2))
    assert sched.schedule() == Step(Action.DECODE)  # none waiting


def test_continuous_finish_of_a_free_slot_raises():
    sched = ContinuousScheduler(_mixed([3, 4], [8, 8]), BUCKETS)
    with pytest.raises(RuntimeError, match="holds no running request"):
        sched.finish(0)
    sched.schedule()
    sched.finish(0)
    with pytest.raises(RuntimeError, match="holds no running request"):
        sched.finish(0)


def test_continuous_without_requests_is_done_at_once():
    sched = ContinuousScheduler([], BUCKETS)
    assert sched.is_done and sched.schedule() == Step(Action.DONE)


def test_step_refill_is_given_exactly_for_refill():
    with pytest.raises(ValueError):
        Step(Action.REFILL)
    with pytest.raises(ValueError):
        Step(Action.DECODE, Refill((0,), (0,), 4, 1))


# --- shared prefix ------------------------------------------------------------------------


def test_shared_prefix_len():
    base = list(range(100, 150))  # 50 tokens
    assert shared_prefix_len([base + [1, 2], base + [3]], 16, 16) == 48  # 50 cut to 48
    assert shared_prefix_len([base[:40] + [1], base[:40] + [2]], 16, 16) == 32
    # every prompt keeps at least one token of its own
    assert shared_prefix_len([base[:32], base[:32] + [7]], 16, 16) == 16
    assert shared_prefix_len([base[:17], base[:17]], 16, 16) == 16
    assert shared_prefix_len([base[:16], base[:16]], 16, 16) == 0
    assert shared_prefix_len([base + [1], base[:20] + [9] + base], 16, 16) == 16
    assert shared_prefix_len([base[:15] + [1], base], 16, 16) == 0  # under the minimum
    assert shared_prefix_len([base], 16, 16) == 0 and shared_prefix_len([], 16, 16) == 0
    assert shared_prefix_len([[5, 6, 7], [8, 6, 7]], 1, 1) == 0


def test_continuous_with_a_prefix_buckets_the_suffixes():
    prefix = list(range(100, 140))  # 40 tokens: 32 reused
    reqs = [Request(i, prefix + list(range(2, 2 + n)), SamplingParams(max_new_tokens=8))
            for i, n in enumerate([3, 30, 4, 20, 2, 9])]  # fmt: skip
    buckets = BucketConfig(max_prompt_len=128, min_bucket=4, max_batch=4)
    sched = ContinuousScheduler(reqs, buckets, prefix_reuse=True)
    assert sched.prefix_len == 32
    # suffixes are 8 + n tokens: 38 the longest, bucket 64
    assert sched.shape == SlotShape(slots=4, prompt_len=64, max_new=16, prefix_len=32)
    assert sched.shape.row_stride == 32 + 64 + 16 and sched.shape.extra_rows == 2
    assert sched.prefix_tokens_saved == 5 * 32
    assert sched.schedule().refill == Refill((0,), (1,), 64, 1)  # suffix 38
    assert sched.schedule().refill == Refill((1, 2), (3, 5), 32, 2)  # 28, 17
    assert sched.schedule().refill == Refill((3,), (2,), 16, 1)  # 12
    sched.finish(0)
    assert sched.schedule().refill == Refill((0,), (0,), 16, 1)  # suffix 8 + 3 tokens
    off = ContinuousScheduler(reqs, buckets)
    assert off.prefix_len == 0 and off.prefix_tokens_saved == 0
