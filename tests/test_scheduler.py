"""StaticScheduler lifecycle and the plain-data request types: no torch, no model."""

import pytest

from batchgen.engine.scheduler import SeqStatus, StaticScheduler
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
