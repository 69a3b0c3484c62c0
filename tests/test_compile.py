"""Compiled decoding: compiled == eager, and no recompilation in steady state.

Decode-only steps run through torch.compile'd graphs, the batch padded to a power of two:
one graph for every batch of 2 and more (the batch axis symbolic, engine/compiled_step.py)
and one for a batch of 1, per variant (greedy-only or not, ...). A warm-up pass compiles
the workload's shapes; the same workload again compiles nothing. Compiling costs seconds on
the CPU, so the test is marked slow; the inductor FX cache in /tmp makes reruns faster.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters

from batchgen.engine.compiled_step import CompiledStep, batch_tensors
from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import FinishReason, Request, SamplingParams
from batchgen.engine.step_inputs import next_pow2
from batchgen.llm import LLM

# Rows of up to 32 + 16 tokens in one 64-token block: every table is 1 block wide, so the
# shapes are at most 4 batch sizes (1, 2, 4, 8) x greedy-only or not, within dynamo's
# recompile limit of 8 for one function. 15 usable blocks: all 7 rows start at once.
ENGINE = EngineConfig(max_num_seqs=8, block_size=64, kv_cache_tokens=1024)


def _workload(seed: int) -> list[Request]:
    """7 rows of 1-32 tokens, 1-16 new tokens, greedy and seeded sampled rows mixed."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(7):
        length = int(torch.randint(1, 33, (1,), generator=g))
        prompt = torch.randint(2, 500, (length,), generator=g).tolist()
        max_new = int(torch.randint(1, 17, (1,), generator=g))
        temperature = 0.0 if i % 3 == 2 else 0.9
        reqs.append(
            Request(
                i,
                prompt,
                SamplingParams(
                    max_new_tokens=max_new,
                    temperature=temperature,
                    top_k=40,
                    top_p=0.95,
                    seed=seed * 100 + i,
                ),
            )
        )
    return reqs


class CompileEvents:
    """Counts dynamo compilation starts while installed (torch._dynamo.reset() removes
    it, so install it after the engine has allocated its cache)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, args) -> None:
        self.n += 1

    def __enter__(self):
        callback_handler.register_start_callback(self)
        return self

    def __exit__(self, *exc) -> None:
        callback_handler.remove_start_callback(self)


def _snapshot() -> dict:
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames": dict(counters["frames"]),
        "aot_autograd": counters["aot_autograd"]["total"],
    }


def _run(llm: LLM, reqs: list[Request]):
    reports = list(llm.engine.generate(reqs))
    done = sorted((c for r in reports for c in r.finished), key=lambda c: c.index)
    assert [c.index for c in done] == list(range(len(reqs)))  # each request once
    for c in done:
        assert (
            len(c.token_ids) == reqs[c.index].params.max_new_tokens
            or c.finish_reason == FinishReason.STOP
        )
    return reports, [c.token_ids for c in done]


@pytest.mark.slow
def test_compiled_equals_eager_and_steady_state_compiles_nothing(tiny_dirs):
    path = tiny_dirs["llama"]
    llm = LLM(path, dtype="float32", device="cpu", compile=True, engine=ENGINE)
    eager = LLM(path, dtype="float32", device="cpu", compile=False, engine=ENGINE)
    reqs = _workload(0)
    _, want = _run(eager, reqs)

    before = _snapshot()
    warm, first = _run(llm, reqs)
    assert first == want
    shapes = set(llm.runner.shapes)
    assert shapes and all(k[0] == "decode" and k[2] == 1 for k in shapes)
    # really compiled, not a silent eager fallback: one dynamo graph per variant and batch
    # class (1, or 2 and more: symbolic), however many padded batch sizes ran
    graphs = {(k[3:], k[1] == 1) for k in shapes}
    assert len(shapes) > len(graphs)
    assert _snapshot()["unique_graphs"] - before["unique_graphs"] == len(graphs)
    decode_only = [r for r in warm if r.decode_rows and not r.prefill]
    assert decode_only
    for r in decode_only:  # the batch padded to a power of two with scratch rows
        assert r.decode_rows + r.padded_rows == next_pow2(r.decode_rows)
    assert sum(r.padded_rows for r in warm) > 0
    assert sum(r.compile_seconds > 0 for r in warm) == len(shapes)  # one first call a shape

    steady = _snapshot()
    graphs = counters["stats"]["unique_graphs"]
    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        again, second = _run(llm, reqs)
    assert second == first
    assert events.n == 0
    assert counters["stats"]["unique_graphs"] == graphs
    assert _snapshot() == steady
    assert llm.runner.shapes == shapes
    assert all(r.compile_seconds == 0 for r in again)
    assert sum(r.seconds for r in again if not r.prefill) > 0  # timed as model time


def _plus_row_index(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + torch.arange(x.shape[0])


def _plus_eight(x: torch.Tensor) -> torch.Tensor:
    return x + torch.arange(8)  # pins the batch to 8: it cannot be symbolic


def test_one_graph_serves_every_batch_size_of_two_and_more():
    step = CompiledStep(_plus_row_index, torch.device("cpu"))
    with CompileEvents() as events:
        for b in (8, 2, 4, 8, 2):
            assert step(torch.ones(b, dtype=torch.long)).tolist() == [2 + i for i in range(b)]
    assert events.n == 1 and step.dynamic
    with CompileEvents() as events:
        assert step(torch.ones(1, dtype=torch.long)).tolist() == [2]  # 1: a graph of its own
        step(torch.ones(1, dtype=torch.long))
    assert events.n == 1


def test_a_batch_that_cannot_be_symbolic_falls_back_to_a_graph_per_size(caplog):
    step = CompiledStep(_plus_eight, torch.device("cpu"))
    x = torch.zeros(8, dtype=torch.long)
    with caplog.at_level("WARNING", logger="batchgen.engine.compiled_step"):
        assert step(x).tolist() == list(range(8))  # this step ran eagerly
    assert not step.dynamic
    assert "one graph per batch size" in caplog.text
    with CompileEvents() as events:
        for _ in range(3):
            assert step(torch.zeros(8, dtype=torch.long)).tolist() == list(range(8))
    assert events.n == 1  # compiled once, statically, then reused


def test_batch_tensors_are_the_per_row_inputs():
    """The marked tensors: plain inputs, SamplingTensors' fields, a flex mask's per-row
    tensors and its mask_mod's tables and lengths; not the pool-sized `logical` map."""
    from batchgen.engine.sampler import SamplingTensors
    from batchgen.model.kv_cache import PagedKVCache
    from batchgen.model.paged_flex import paged_block_mask

    b = 4
    cache = PagedKVCache(8, 16, 2, 8, torch.float32, "cpu")
    tables = torch.tensor([[1, 2], [3, 0], [4, 5], [6, 0]])
    lens = torch.tensor([20, 5, 30, 9])
    mask = paged_block_mask(tables, lens, None, cache, queries=2, width=8)
    samp = SamplingTensors(torch.zeros(b), torch.zeros(b), torch.ones(b), torch.zeros(b))
    found = list(batch_tensors((torch.zeros(b), mask, None, samp, True), b))
    # tokens; kv_num_blocks, kv_indices; tables, lens; the 4 sampling columns
    assert len(found) == 1 + 2 + 2 + 4
    assert all(t.shape[0] == b for t in found)
    assert not any(t.shape[0] == cache.num_blocks + 1 for t in found)


def test_an_eager_job_never_imports_dynamo(model, tmp_path):
    """torch._dynamo takes ~1 s to import: a job run without --compile must not pay it."""
    import subprocess
    import sys

    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hello there"}\n')
    code = (
        "import sys\n"
        "from batchgen.cli.main import main\n"
        f"args = ['run', {str(data)!r}, '-o', {str(tmp_path / 'out')!r}, '--model', "
        f"{str(model)!r}, '--max-new-tokens', '3', '--quiet']\n"
        "try:\n    main(args)\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'eager')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert (tmp_path / "out" / "_SUCCESS").exists()
    assert out.stdout.strip().splitlines()[-1] == "eager", out.stderr[-2000:]
