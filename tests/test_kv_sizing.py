"""The KV pool's sizing (engine/kv_sizing.py) on a fake runner: which source sizes it, the
order of allocation and warm-up each source needs, and the longest row a job-sized pool holds.
The rule's arithmetic: tests/test_scheduler.py; on a real model: tests/test_pool_sizing.py."""

import pytest

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_sizing import PoolSizer
from batchgen.engine.sequence import Request, SamplingParams
from batchgen.model.memory import AllocationTooLarge


class FakeRunner:
    """What PoolSizer asks of a ModelRunner, recording the calls in order."""

    max_positions = 100
    host_ranks = 1
    device = "cpu"

    def __init__(self, measures_memory: bool = False, budget: int = 0) -> None:
        self.measures_memory, self.budget, self.calls = measures_memory, budget, []

    def kv_bytes_per_block(self) -> int:
        return 10

    def max_pool_blocks(self) -> int | None:
        return None

    def allocate(self, blocks: int) -> None:
        self.calls.append(("allocate", blocks))

    def warm_up(self, max_num_seqs: int, max_tokens: int) -> str:
        self.calls.append(("warm_up",))
        return "warm"

    def rewarm_attention(self, max_num_seqs: int) -> None:
        self.calls.append(("rewarm",))

    def kv_budget_bytes(self, utilization: float) -> int:
        self.calls.append(("budget", utilization))
        return self.budget


def _request(prompt_len: int, max_new: int) -> Request:
    return Request(0, list(range(prompt_len)), SamplingParams(max_new_tokens=max_new))


def test_the_job_sizes_a_cpu_pool_allocated_before_the_warm_up():
    cfg = EngineConfig(max_num_seqs=4, block_size=16)
    runner = FakeRunner()
    sized = PoolSizer(cfg).start(runner, [_request(30, 10), _request(5, 5)])
    assert sized.kv_pool.num_blocks == 1 + 4 * 3  # 40 tokens: 3 blocks a row, 4 rows
    assert sized.kv_pool.bytes == sized.kv_pool.num_blocks * 10
    assert sized.holds_full_rows and sized.warm == "warm"
    assert runner.calls == [("allocate", 13), ("warm_up",)]


def test_a_reserved_job_row_wins_over_the_first_requests_and_positions_cap_it():
    sizer = PoolSizer(EngineConfig(max_num_seqs=4, block_size=16))
    sizer.reserve(70)
    sizer.reserve(50)  # the longest reserved stays
    assert sizer.longest_row([_request(30, 10)], max_positions=100) == 70
    assert sizer.longest_row([_request(90, 40)], max_positions=100) == 100
    assert PoolSizer(EngineConfig()).longest_row([], max_positions=100) == 1


def test_a_measured_pool_warms_up_on_two_blocks_first():
    cfg = EngineConfig(max_num_seqs=4, block_size=16, gpu_memory_utilization=0.5)
    runner = FakeRunner(measures_memory=True, budget=400)
    sized = PoolSizer(cfg).start(runner, [_request(30, 10)])
    assert sized.kv_pool.num_blocks == 40 and not sized.holds_full_rows
    assert runner.calls == [
        ("allocate", 2),
        ("warm_up",),
        ("budget", 0.5),
        ("allocate", 40),
        ("rewarm",),
    ]


def test_the_flag_wins_and_skips_the_measuring():
    cfg = EngineConfig(max_num_seqs=4, block_size=16, kv_cache_tokens=100)
    runner = FakeRunner(measures_memory=True, budget=400)
    sized = PoolSizer(cfg).start(runner, [_request(30, 10)])
    assert sized.kv_pool.num_blocks == 7 and not sized.holds_full_rows
    assert runner.calls == [("allocate", 7), ("warm_up",)]


def test_a_job_sized_pool_is_checked_against_memory(monkeypatch):
    import batchgen.model.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 100)
    runner = FakeRunner()
    with pytest.raises(AllocationTooLarge, match="sized from the job"):
        PoolSizer(EngineConfig(max_num_seqs=4, block_size=16)).start(runner, [_request(30, 10)])
    assert runner.calls == []  # nothing allocated
