"""FlexAttention decode reading the paged pool in place (the CUDA path,
model/attention/paged_flex.py) against the gather + SDPA path (the CPU's), on the CPU: eager flex,
and compiled in a slow test.

The attention itself over scattered, shared and padded blocks with stale keys everywhere,
with and without a sliding window, for 1, 2 and 3 query heads per kv head; then whole engine
runs forced onto flex (BATCHGEN_DECODE_ATTENTION=flex) against the default path: the same
greedy tokens and close logprobs for each family, under chunked prefill, preemption and
prefix-cache hits, at two tensor-parallel ranks, and compiled with no recompiles in steady
state. On a GPU, tests/test_gpu.py runs the compiled CUDA kernel (scripts/gpu_check.sh).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from test_compile import CompileEvents
from test_tensor_parallel_ranks import _assert_tp_matches

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.attention import decode_ops
from batchgen.model.attention import step as attention
from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.paged_flex import (
    block_mask,
    flex_decode_attention,
    list_width,
    pad_rows,
    paged_mask,
)
from batchgen.model.attention.step import (
    DECODE_ATTENTION_ENV,
    DecodeBackend,
    decode_attention,
    decode_backend,
    decode_mask,
)

TOL = dict(rtol=1e-4, atol=1e-5)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("g", [1, 2, 3])
def test_flex_over_the_pool_equals_the_gather(window, g, monkeypatch):
    torch.manual_seed(g)
    bs, hkv, d, num_blocks = 4, 2, 8, 24
    cache = PagedKVCache(num_blocks, bs, hkv, d, torch.float32, "cpu")
    cache.k.normal_(0, 100)  # stale everywhere: the mask must hide every key not read
    cache.v.normal_(0, 100)
    lens = torch.tensor([13, 5, 1, 8, 16])
    tables = torch.tensor(
        [
            [7, 2, 9, 11],
            [5, 3, 0, 0],
            [4, 0, 0, 0],
            [7, 2, 0, 0],  # row 0's first two blocks: a prefix-cache hit
            [7, 2, 9, 20],  # three of them, a block of its own last
        ]
    )
    for row, n in zip(tables.tolist(), lens.tolist(), strict=True):  # the keys read: O(1)
        slots = torch.tensor([row[p // bs] * bs + p % bs for p in range(n)])
        cache.write(slots, torch.randn(n, hkv, d), torch.randn(n, hkv, d))
    q = torch.randn(5, hkv * g, d)
    mask = decode_mask(lens, tables.shape[1] * bs, window)
    want = decode_attention(q, cache.k, cache.v, bs, tables, mask)

    padded, plens = pad_rows(tables, lens)  # 5 rows -> 8: padding rows on the scratch block
    assert padded.shape == (8, 4) and plens[5:].tolist() == [1, 1, 1]
    paged = paged_mask(padded, plens, window, num_blocks, bs, width=num_blocks)
    mask = block_mask(paged, window, bs, g)
    assert mask.kv_indices.shape == (8, 1, 1, num_blocks)  # the fixed width, past the tables'
    # the rows' block lists: from the first block inside the window to the last one
    first = [max(0, n - (window or n)) // bs for n in lens.tolist()]
    assert mask.kv_num_blocks[:5, 0, 0].tolist() == [
        (n - 1) // bs - f + 1 for n, f in zip(lens.tolist(), first, strict=True)
    ]
    assert mask.kv_indices[0, 0, 0, 0] == tables[0, first[0]]

    def no_copy(*a):
        raise AssertionError("the flex path copied the KV")

    monkeypatch.setattr(PagedKVCache, "gather", no_copy)
    monkeypatch.setattr(decode_ops, "gather_blocks", no_copy)
    qp = torch.cat([q, q.new_zeros(3, *q.shape[1:])])
    got = flex_decode_attention(qp, cache.k, cache.v, paged, window, bs, compiled=False)[:5]
    torch.testing.assert_close(got, want, **TOL)


def test_one_path_per_device(monkeypatch):
    monkeypatch.delenv(DECODE_ATTENTION_ENV, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_backend(cpu, 16, 64) is DecodeBackend.GATHER
    assert decode_backend(cuda, 16, 64) is DecodeBackend.FLEX
    assert decode_backend(cuda, 64, 128) is DecodeBackend.FLEX
    # shapes the CUDA kernel cannot tile keep the gather
    assert decode_backend(cuda, 8, 64) is DecodeBackend.GATHER
    assert decode_backend(cuda, 24, 64) is DecodeBackend.GATHER
    assert decode_backend(cuda, 16, 8) is DecodeBackend.GATHER
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    assert decode_backend(cpu, 4, 8) is DecodeBackend.FLEX
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "gather")
    assert decode_backend(cuda, 16, 64) is DecodeBackend.GATHER
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="flex|gather"):
        decode_backend(cpu, 16, 64)


def test_block_lists_have_one_width_a_model():
    """The most blocks a sequence can hold (max positions / block size, at most the pool);
    on the CPU the whole pool, as inductor's CPU kernel wants."""
    gpu_like = PagedKVCache(100, 16, 2, 8, torch.float32, "meta")  # any device but the CPU
    assert list_width(gpu_like, 1000) == 63 and list_width(gpu_like, 10**6) == 100
    assert list_width(PagedKVCache(100, 16, 2, 8, torch.float32, "cpu"), 1000) == 100


# Rows of 1-25 tokens, and 4 of them again after a shared 8-token prefix, finishing after 1-12
# new tokens (or at EOS).
LENS = [3, 11, 6, 17, 1, 25, 9]
MAX_NEW = [5, 12, 3, 12, 1, 12, 8]
# 3 rows at a time, 5 tokens a step, 10 usable blocks of 4: chunked prefill next to decodes,
# preemption and recompute, prefix-cache hits.
TIGHT = EngineConfig(max_num_seqs=3, max_num_batched_tokens=5, block_size=4, kv_cache_tokens=44)


def _rows() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    plain = [torch.randint(2, 500, (n,), generator=g).tolist() for n in LENS]
    prefix = torch.randint(2, 500, (8,), generator=g).tolist()
    rows = plain + [prefix + r for r in plain[:4]]
    return rows, [SamplingParams(max_new_tokens=m) for m in MAX_NEW + MAX_NEW[:4]]


@pytest.fixture
def flex_calls(monkeypatch) -> list[int]:
    """The rows of each flex decode call, while counting them (and failing any gather one)."""
    calls = []
    real = attention.flex_decode_attention

    def spy(q, *args):
        calls.append(q.shape[0])
        return real(q, *args)

    def no_gather(*a):
        raise AssertionError("a decode went through the gather path")

    monkeypatch.setattr(attention, "flex_decode_attention", spy)
    monkeypatch.setattr(attention, "decode_attention", no_gather)
    return calls


def _generate(path, engine, monkeypatch, backend: str, **kw):
    monkeypatch.setenv(DECODE_ATTENTION_ENV, backend)
    llm = LLM(path, dtype="float32", device="cpu", engine=engine, **kw)
    assert llm.runner.attention is DecodeBackend(backend)
    rows, params = _rows()
    return llm, llm.generate(rows, params)


@pytest.mark.parametrize("family", ["llama", "mistral-window4", "qwen2", "gpt2", "llama-kv1"])
def test_engine_on_flex_equals_the_gather(
    family, tiny_dirs, window_dir, one_kv_head, monkeypatch, request
):
    path = {"mistral-window4": window_dir, "llama-kv1": one_kv_head}.get(family)
    path = path or tiny_dirs[family]
    _, want = _generate(path, TIGHT, monkeypatch, "gather")
    calls = request.getfixturevalue("flex_calls")
    llm, got = _generate(path, TIGHT, monkeypatch, "flex")
    assert calls and all(n & (n - 1) == 0 for n in calls)  # padded to powers of two
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.pool.hits > 0
    assert sum(c.cached_tokens > 0 for c in got) > 0
    for a, b in zip(got, want, strict=True):
        assert a.error is None and a.token_ids == b.token_ids, f"row {a.index}"
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


def test_two_ranks_on_flex_give_one_rank_tokens(one_kv_head, monkeypatch):
    """Each rank's attention reads its own pool of its local heads (here the one KV head,
    replicated): the flex ranks give the tokens of one gather process."""
    engine = EngineConfig(max_num_seqs=4, block_size=4, kv_cache_tokens=256)
    _, want = _generate(one_kv_head, engine, monkeypatch, "gather")
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    rows, params = _rows()
    kw = dict(dtype="float32", device="cpu", engine=engine, tensor_parallel_size=2)
    with LLM(one_kv_head, **kw) as llm:
        assert llm.runner.attention is DecodeBackend.FLEX
        got = [c.token_ids for c in llm.generate(rows, params)]
    _assert_tp_matches(one_kv_head, [c.token_ids for c in want], got, rows)


@pytest.mark.slow
def test_compiled_flex_decode_equals_eager_and_compiles_nothing_twice(model, monkeypatch):
    """The compiled decode step with the mask's tensors as inputs: one graph for 4 rows
    decoding together, though a row's table grows from 1 to 2 blocks; none more on a second
    pass."""
    engine = EngineConfig(max_num_seqs=4, block_size=64, kv_cache_tokens=512)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 9, 14, 60)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "gather")
    eager = LLM(model, dtype="float32", device="cpu", compile=False, engine=engine)
    want = [c.token_ids for c in eager.generate(rows, params)]
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    llm = LLM(model, dtype="float32", device="cpu", compile=True, engine=engine)
    assert [c.token_ids for c in llm.generate(rows, params)] == want
    assert llm.runner.graph.graphs <= 1 and not llm.runner.graph.failed
    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        again = [c.token_ids for c in llm.generate(rows, params)]
    assert again == want and events.n == 0


def test_decode_micro_benchmark_runs_and_both_paths_agree(tmp_path):
    """scripts/bench_paged_decode.py (the GPU check's gather-vs-flex figures) as a whole
    process on a tiny CPU shape: both paths timed, their outputs equal, the JSON written."""
    out = tmp_path / "decode.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_paged_decode.py"
    args = "--device cpu --dtype float32 --rows 2,4 --ctx 64 --kv-heads 2 --head-dim 16"
    args += " --q-per-kv 2 --window 40 --warmup 1 --reps 2"
    r = subprocess.run(
        [sys.executable, str(script), *args.split(), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "| 4 x 64 |" in r.stdout
    results = json.loads(out.read_text())["results"]
    assert [x["rows"] for x in results] == [2, 4]
    for x in results:
        assert (
            x["gather_ms"] > 0
            and x["flex_ms"] > 0
            and x["kv_bytes"] == x["rows"] * 64 * 2 * 16 * 2 * 4
        )
        assert x["max_abs_diff"] < 1e-4


def test_flex_pool_stays_within_int32_indexing(model, monkeypatch):
    """Flex reads a layer's pool as one sequence: its K stays under 2**31 elements (past
    that the CUDA decoding kernel, indexed in int64, fails to compile), whatever sizes it."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "gather")
    assert LLM(model, dtype="float32", device="cpu").runner.max_pool_blocks() is None
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    engine = EngineConfig(max_num_seqs=4, block_size=16, kv_cache_tokens=4096)
    llm = LLM(model, dtype="float32", device="cpu", engine=engine)
    cfg = llm.model.cfg
    per_block = 16 * cfg.n_kv_heads * cfg.head_dim
    assert llm.runner.max_pool_blocks() == (2**31 - 1) // per_block
    monkeypatch.setattr(type(llm.runner), "max_pool_blocks", lambda self: 40)
    llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))  # the pool is sized here
    assert llm.model.kv_caches[0].num_blocks == 40  # capped below the flag's 256 blocks


def test_flex_kernel_options_come_from_the_table_and_the_override():
    """One table per capability (inductor's choice, BLOCK_N at most the cache block), and
    BATCHGEN_FLEX_OPTIONS over it; a bad override is one line naming the fix."""
    from batchgen.model.attention.paged_flex import FLEX_OPTIONS_ENV, kernel_options

    assert kernel_options((9, 0), 16, None) == {"BLOCK_N": 16}
    assert kernel_options((9, 0), 128, None) == {"BLOCK_N": 64}
    given = '{"num_warps": 4, "num_stages": 2, "BLOCK_N": 8}'
    assert kernel_options((9, 0), 16, given) == {"BLOCK_N": 8, "num_warps": 4, "num_stages": 2}
    for bad in ('{"num_warps": 0}', '{"BLOCK_M": 16}', "[4]", "not json", '{"BLOCK_N": 32}'):
        with pytest.raises(ValueError, match=FLEX_OPTIONS_ENV) as e:
            kernel_options((9, 0), 16, bad)
        assert "\n" not in str(e.value)
