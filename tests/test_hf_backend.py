"""The transformers backend (model/hf/backend.py): families batchgen has no native code for run
on its engine, token for token equal to transformers' greedy generate, under every scheduling
mode (packed prefill, chunked prefill, preemption, prefix-cache hits). Controls: without the
layer's soft-cap, sliding window, scale or sinks the tokens change, so the equality is not
luck. Refusals exit 2 before any weight loads."""

import json

import pytest
from helpers import (
    assert_live_equal,
    assert_one_line_error,
    assert_pressed,
    cached,
    hf_greedy,
    prompts,
    random_prompts,
    read_stats,
    run_cli,
    write_parquet,
)
from tiny_hf_models import FAMILIES, HYBRIDS, save_tiny_hf_model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.errors import UsageError
from batchgen.job.config import RunConfig
from batchgen.job.fingerprint import options_fingerprint
from batchgen.llm import LLM
from batchgen.model.attention import step as attention
from batchgen.model.attention.step import DECODE_ATTENTION_ENV
from batchgen.model.hf import backend as hf_backend

MAX_NEW = 12
PARAMS = SamplingParams(max_new_tokens=MAX_NEW)
# chunks of <= 5 tokens, 3 rows at a time, 10 usable blocks of 4 (rows need up to 8): chunked
# prefill, decodes beside chunks, preemption; the prefixed rows hit the cached prefix.
TIGHT = EngineConfig(max_num_seqs=3, max_num_batched_tokens=5, block_size=4, kv_cache_tokens=44)


def _prompts() -> list[list[int]]:
    (prefix,) = random_prompts([13], seed=7)
    return random_prompts([3, 11, 6, 17, 1]) + [prefix + p for p in random_prompts([2, 5, 4], 1)]


@pytest.fixture(scope="module")
def references(hf_dirs):
    """model_type -> transformers' greedy tokens for _prompts()."""
    return cached(lambda model_type: hf_greedy(hf_dirs(model_type), _prompts(), MAX_NEW))


def _generate(model_dir, engine=None, model_impl="transformers"):
    """auto picks native for llama: the backend unless told otherwise."""
    llm = LLM(model_dir, dtype="float32", device="cpu", engine=engine, model_impl=model_impl)
    return llm, [c.token_ids for c in llm.generate(_prompts(), PARAMS)]


@pytest.mark.parametrize("engine", [None, TIGHT], ids=["packed", "chunked-preempted-hit"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_greedy_equals_transformers(model_type, engine, hf_dirs, references):
    llm, got = _generate(hf_dirs(model_type), engine)
    assert llm.spec.model_cfg.impl == "transformers"
    assert_live_equal(got, references(model_type))
    if engine is TIGHT:
        assert_pressed(llm)


def test_layers_of_different_shapes_get_their_own_pools(hf_dirs):
    llm, _ = _generate(hf_dirs("gemma4_text"))  # sliding layers 16 wide, global layers 32
    assert [c.k.shape[1:] for c in llm.model.kv_caches] == [(2, 16), (2, 32)]
    cfg = llm.spec.model_cfg
    assert cfg.kv_bytes_per_token(4) == 2 * (2 * 16 + 2 * 32) * 4


def test_llama_backend_equals_native(hf_dirs):
    d = hf_dirs("llama")
    native, got_native = _generate(d, model_impl="native")
    backend, got_backend = _generate(d, TIGHT, model_impl="transformers")
    assert native.spec.model_cfg.impl == "native" and backend.spec.model_cfg.impl != "native"
    assert got_backend == got_native


def _without(monkeypatch, **dropped):
    """The backend's attention called with some of its layer's arguments replaced."""

    def attention(module, q, k, v, mask, scaling=None, **kw):
        kw = {**kw, **dropped}
        return hf_backend._attention(module, q, k, v, mask, kw.pop("scaling", scaling), **kw)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "batchgen", attention)


@pytest.mark.parametrize(
    "model_type, dropped",
    [
        ("gemma2", {"softcap": None}),
        ("gemma3_text", {"sliding_window": None}),
        ("granite", {"scaling": None}),  # attention_multiplier 0.5, not 1/sqrt(16)
        ("gpt_oss", {"s_aux": None}),
    ],
)
def test_removing_a_feature_changes_the_tokens(
    model_type, dropped, hf_dirs, references, monkeypatch
):
    llm = LLM(hf_dirs(model_type), dtype="float32", device="cpu", model_impl="transformers")
    _without(monkeypatch, **dropped)
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got != references(model_type)


def test_llama4s_chunks_matter(hf_dirs, references, monkeypatch):
    """Chunks of 8 positions, prompts longer: attending across chunks changes the tokens, and
    the NoPE layer's temperature is 1 below floor_scale, which bounds the model's positions."""
    llm = LLM(hf_dirs("llama4_text"), dtype="float32", device="cpu")
    assert llm.spec.model_cfg.max_position_embeddings == 256  # under floor_scale (8192)
    monkeypatch.setattr(hf_backend, "_layer_type", lambda config, i: None)
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got != references("llama4_text")


def test_a_rope_that_switches_with_the_longest_row_is_served_below_its_switch(tmp_path):
    """longrope picks short or long factors from the largest position in a forward: packed,
    one long row would switch every row's. The backend serves such a model up to its original
    context (64 here), where the choice never switches, so every row equals transformers'."""
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    path = save_tiny_hf_model(
        "phi3", tmp_path / "phi3", rope_scaling=rope, original_max_position_embeddings=64
    )
    llm = LLM(path, dtype="float32", device="cpu", model_impl="transformers")
    assert llm.spec.model_cfg.max_position_embeddings == 64
    rows = [r[:40] for r in _prompts()]
    got = [c.token_ids for c in llm.generate(rows, PARAMS)]
    assert got == hf_greedy(path, rows, MAX_NEW)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_hybrids_are_refused_before_loading(model_type, hf_dirs):
    with pytest.raises(UsageError, match="cannot run on the transformers backend"):
        LLM(hf_dirs(model_type), device="cpu")


@pytest.mark.parametrize(("model_type", "name"), [("stablelm", "StableLM"), ("falcon", "Falcon")])
def test_families_with_attention_of_their_own_are_refused_naming_why(model_type, name, hf_dirs):
    """README's "any causal LM whose layers are all softmax attention" excludes, by name, the
    families whose transformers classes compute attention in their own code (issue 38)."""
    with pytest.raises(UsageError) as e:
        LLM(hf_dirs(model_type), device="cpu")
    for words in (name, "computes its attention in its own code", "no native", "README"):
        assert words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"quantize": "int4"}, "--quantize int4"),
    ],
)
def test_backend_refuses_what_it_does_not_do(options, words, hf_dirs):
    with pytest.raises(UsageError, match=words):
        LLM(hf_dirs("olmo2"), device="cpu", **options)


# soft-cap; sinks; a scale not 1/sqrt(head_dim); MLA's keys and values of two sizes
FLEX_CASES = ["gemma2", "gpt_oss", "granite", "deepseek_v3"]


@pytest.mark.parametrize("model_type", FLEX_CASES)
def test_the_flex_path_carries_each_layers_attention(model_type, hf_dirs, references, monkeypatch):
    """CUDA's decode path (FlexAttention over the pool in place), forced on the CPU, eager
    flex: the layer's scale, soft-cap and sinks go into the kernel, and the tokens equal
    transformers'."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    calls = []
    flex = attention.flex_decode_attention
    monkeypatch.setattr(attention, "flex_decode_attention", lambda *a: calls.append(1) or flex(*a))
    llm = LLM(
        hf_dirs(model_type), dtype="float32", device="cpu", engine=EngineConfig(block_size=16)
    )
    assert [c.token_ids for c in llm.generate(_prompts(), PARAMS)] == references(model_type)
    assert calls  # the decodes went through flex, not the gather


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_the_flex_path_at_the_gpus_head_dims(model_type, head_dim, hf_dirs, monkeypatch):
    """The GPU's defaults on the backend: block 16 with the head sizes of real models, the
    soft-cap (gemma2) and the sinks (gpt_oss) in flex's kernel, eager."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    path = hf_dirs(model_type, head_dim=head_dim)
    llm = LLM(path, dtype="float32", device="cpu", engine=EngineConfig(block_size=16))
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got == hf_greedy(path, _prompts(), MAX_NEW)
    assert {c.k.shape[-1] for c in llm.model.kv_caches} == {head_dim}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, path, head_dim, compiled",
    [
        ("gemma2", "gather", None, True),  # native (batchgen's Gemma): compiled
        ("gpt_oss", "gather", None, False),  # the transformers backend: eager
        ("deepseek_v3", "gather", None, False),
        ("gemma2", "flex", None, True),
        ("gemma2", "flex", 128, True),  # ... at the GPU's block 16 and a real model's head size
        ("granite", "flex", None, False),
    ],
)
def test_compile_equals_transformers(model_type, path, head_dim, compiled, hf_dirs, monkeypatch):
    """--compile: a native family's forward is one graph over a symbolic token count; the
    transformers backend's forward is transformers' own, with no `hidden` seam for the
    compiled forward (engine/compiled_forward.py), so its steps run eagerly, through the same
    attention with the layer's scale, soft-cap and sinks."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, path)
    model_dir = hf_dirs(model_type, **({"head_dim": head_dim} if head_dim else {}))
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        compile=True,
        compile_cache="off",
        engine=EngineConfig(block_size=16),
    )
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got == hf_greedy(model_dir, _prompts(), MAX_NEW)
    graph = llm.runner.graph  # (0 graphs: an earlier engine in the process compiled it)
    assert (graph is not None) == compiled and (graph is None or graph.graphs <= 1)


def test_native_is_refused_for_a_family_it_lacks(hf_dirs):
    with pytest.raises(UsageError, match="no native implementation"):
        LLM(hf_dirs("olmo2"), device="cpu", model_impl="native")


@pytest.mark.parametrize("model_type", ["gemma4_text", "deepseek_v3", "olmo2", "gpt_oss"])
def test_cli_run_and_plan(model_type, hf_dirs, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    out = tmp_path / "out"
    run_cli("run", src, "-o", out, "--model", hf_dirs(model_type), "--max-new-tokens", 4)
    stats = read_stats(out)
    assert stats["model_impl"] == "transformers" and stats["family"] == model_type
    plan = json.loads(run_cli("plan", src, "--model", hf_dirs(model_type), "--json").stdout)
    assert plan["model_impl"] == "transformers" and plan["model_type"] == model_type


def test_cli_refusals_exit_2(hf_dirs, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_cli("run", src, "-o", tmp_path / "a", "--model", hf_dirs("qwen3_next"), exit_code=2)
    assert_one_line_error(r, "qwen3_next", "transformers backend")
    olmo2 = hf_dirs("olmo2")
    r = run_cli("run", src, "-o", tmp_path / "b", "--model", olmo2, "-tp", 2, exit_code=2)
    assert_one_line_error(r, "tensor parallelism")


def test_model_impl_is_a_run_option():
    """Either implementation writes the same tokens: a rerun may switch and resume."""
    cfg = RunConfig(input="in.parquet", output="out", model_impl="transformers")
    assert cfg.model_impl == "transformers" and "model_impl" not in options_fingerprint(cfg)
