"""The host's side of a step (issue: the host never holds the device): block tables kept in
step with the scheduler instead of rebuilt, a step's inputs in one buffer, one device -> host
read a step, sampling that pays only for what its rows ask, and the host's time between
steps in the stats."""

import random

import numpy as np
import pytest
import torch
from helpers import read_stats, run_job, write_jsonl

from batchgen.engine.block_pool import BlockPool
from batchgen.engine.block_table import BlockTables
from batchgen.engine.config import EngineConfig
from batchgen.engine.input_buffer import InputBuffer
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request, SamplingParams, SeqStatus
from batchgen.engine.step_inputs import pack_step
from batchgen.llm import LLM

# ------------------------------------------------------------------ block tables (no torch)


def _check_rows(tables: BlockTables, seqs) -> None:
    for seq in seqs:
        r = tables.row(seq)
        assert tables.table[r, : len(seq.block_table)].tolist() == seq.block_table


def test_block_tables_follow_the_scheduler_through_growth_preemption_and_finishes():
    """A scheduler run with a pool small enough to preempt: after every step, each planned
    sequence's row equals its list (grown in place, replaced on readmission), and finished
    sequences' rows are reused."""
    rng = random.Random(0)
    pool = BlockPool(num_blocks=40, block_size=4, prefix_caching=True)
    sched = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=24, eos_ids=(2,))
    for i in range(30):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(2, 30))]
        sched.add(Request(i, prompt, SamplingParams(max_new_tokens=rng.randrange(1, 25))))
    tables = BlockTables(rows=2, width=2)  # both grow
    preempted = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        preempted += len(plan.preempted)
        _check_rows(tables, [s.seq for s in plan.scheduled])
        sampled = [(7, -0.1, None) for s in plan.scheduled if s.samples]
        for seq in sched.update(plan, sampled, []):
            assert seq.status is SeqStatus.FINISHED
            tables.release(seq)
    assert preempted > 0  # the case of a replaced list was met
    assert len(tables) == 0 and tables.table.shape[0] <= 8


def test_a_full_table_takes_back_finished_rows_before_growing():
    tables = BlockTables(rows=2, width=4)

    class Seq:
        def __init__(self, blocks):
            self.block_table, self.status = blocks, SeqStatus.RUNNING

    a, b, c = Seq([1, 2]), Seq([3]), Seq([4, 5, 6, 7, 8])
    tables.row(a), tables.row(b)
    a.status = SeqStatus.FINISHED
    assert tables.row(c) == 1 - tables.row(b)  # a's row, taken back: no growth
    assert tables.table.shape == (2, 8)  # widened for c's five blocks
    assert tables.table[tables.row(c), :5].tolist() == [4, 5, 6, 7, 8]


# ------------------------------------------------------------------ inputs


def test_a_steps_inputs_are_views_of_one_buffer(model):
    """pack_step's arrays go to the device as one buffer (on a GPU one copy): every input of
    a mixed step (decodes in width groups, a prefill with cached context) is a view of it,
    and holds what the plan says."""
    pool = BlockPool(num_blocks=64, block_size=4, prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=12, eos_ids=())
    for i, n in enumerate([3, 9, 30, 50]):
        sched.add(Request(i, list(range(10, 10 + n)), SamplingParams(max_new_tokens=20)))
    tables = BlockTables()
    for _ in range(20):  # to a step of decodes and a long prompt's later chunk
        plan = sched.schedule()
        if plan.decodes and plan.prefills and plan.prefills[0].start > 0:
            break
        sched.update(plan, [(5, 0.0, None) for s in plan.scheduled if s.samples], [])
    assert plan.decodes and plan.prefills and plan.prefills[0].start > 0
    packed = pack_step(plan, tables, block_size=4)
    d = InputBuffer(torch.device("cpu")).upload(packed.inputs)
    tensors = [d.tokens, d.positions, d.slots, d.logits_index]
    tensors += [t for _, blocks, lens in d.decodes for t in (blocks, lens)]
    tensors += [b for *_, b in d.prefills if b is not None]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    chunk = plan.prefills[0]
    q, n, ctx, blocks = d.prefills[0]
    assert (n, ctx) == (chunk.num_tokens, chunk.start)
    assert d.tokens[q : q + n].tolist() == chunk.seq.token_ids[ctx : ctx + n]
    assert blocks.tolist() == chunk.seq.block_table[: -(-(ctx + n) // 4)]
    slots = [chunk.seq.block_table[p // 4] * 4 + p % 4 for p in range(ctx, ctx + n)]
    assert d.slots[q : q + n].tolist() == slots


# ------------------------------------------------------------------ one read a step


class HostReads:
    """Counts the ways a tensor reaches the host (each a device sync on a GPU)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **k):
                self.n += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _decode_step_reads(llm: LLM, params: SamplingParams, monkeypatch) -> list[int]:
    reqs = [Request(i, list(range(3, 3 + 4 * i + 2)), params) for i in range(6)]
    steps = llm.engine.generate(reqs)
    next(steps)  # the warm-up
    reads, counts = HostReads(monkeypatch), []
    while True:
        before = reads.n
        try:
            report = next(steps)
        except StopIteration:
            break
        if report.decode_rows and not report.prefill:
            counts.append(reads.n - before)
    monkeypatch.undo()
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_a_decode_step_reads_the_device_once(model, compile, monkeypatch):
    """Greedy, and sampled with top-p and top logprobs: a decode step (planning, inputs,
    forward, sampling, update) reads from the device once: its sampled tokens."""
    engine = EngineConfig(max_num_seqs=8, block_size=16, kv_cache_tokens=1024)
    llm = LLM(model, dtype="float32", device="cpu", compile=compile, engine=engine)
    for params in (
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(
            max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, top_logprobs=3
        ),
    ):
        counts = _decode_step_reads(llm, params, monkeypatch)
        assert len(counts) >= 8 and max(counts) == 1, counts


# ------------------------------------------------------------------ sampling pays for what it asks


@pytest.mark.parametrize(
    "params, sorts",
    [
        (SamplingParams(max_new_tokens=6, temperature=0.7, ignore_eos=True), False),
        (SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, ignore_eos=True), True),
    ],
    ids=["no-filter", "top-k"],
)
def test_the_vocabulary_is_sorted_only_when_a_row_filters(model, params, sorts, monkeypatch):
    llm = LLM(model, dtype="float32", device="cpu", engine=EngineConfig(max_num_seqs=4))
    calls = []
    orig = torch.Tensor.sort
    monkeypatch.setattr(
        torch.Tensor, "sort", lambda t, *a, **k: calls.append(1) or orig(t, *a, **k)
    )
    done = [c for r in llm.engine.generate([Request(0, [5, 6, 7], params)]) for c in r.finished]
    assert len(done[0].token_ids) == 6
    assert bool(calls) is sorts


# ------------------------------------------------------------------ stats


def test_stats_give_the_hosts_time_between_steps(model, tmp_path):
    """stats.json's host_gap_s: p50 and total of the time from one step's results to the
    next step's launch (a GPU's idle time), within the job's engine time; the timeline has
    it per step (the first step none)."""
    import pyarrow.parquet as pq

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i} " * (i + 1)} for i in range(12)])
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 6, "--max-num-seqs", 4)
    stats = read_stats(out)
    gap = stats["host_gap_s"]
    assert 0 < gap["p50"] <= gap["total"] < stats["wall_s"]
    steps = pq.read_table(next((out / ".batchgen" / "steps").glob("*.pq"))).to_pydict()
    gaps = np.array(steps["host_gap_s"])
    assert np.isnan(gaps[0]) and (gaps[1:] > 0).all()
    assert gaps[1:].sum() == pytest.approx(gap["total"])
    # the report's time breakdown shows it as a phase of its own
    from batchgen.report.charts import phases

    shown = {label: sec for label, sec, _ in phases(stats)}
    assert shown["the host between steps (a GPU's idle time)"] == pytest.approx(gap["total"])
