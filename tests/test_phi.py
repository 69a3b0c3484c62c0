"""Native Phi-3 / Phi-4 (model_type phi3): fused qkv_proj and gate_up_proj, partial rotary, and
longrope's per-row choice of factors (model/families/longrope.py). Greedy float32 tokens equal to
transformers' generate on tiny sharpened models under packed and chunked prefill, preemption
and prefix hits; longrope rows each equal to transformers running that row alone: short rows,
long rows (prompts over original_max_position_embeddings, 64 here, of 256) and a row that grows
past it and is recomputed. Equal to the transformers backend, two tensor-parallel ranks equal
to one, LoRA on the fused matrices equal to peft's merge, the CLI. Controls: no window, full
rotary, long factors for short rows, short factors for long rows, no recompute where a row grows
past the original context, and no prefix-cache salt for long rows each change the tokens."""

import dataclasses

import pytest
import torch
import transformers
from helpers import (
    cached,
    decoder_config,
    hf_greedy,
    make_adapter,
    prompt_file,
    random_prompts,
    read_stats,
    run_job,
)
from test_hf_backend import MAX_NEW, PARAMS, TIGHT, _prompts
from test_tensor_parallel_ranks import ENGINE as TP_ENGINE
from test_tensor_parallel_ranks import GREEDY, PROMPTS, _assert_tp_matches

from batchgen.engine import scheduler
from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.config import LongRopeRows
from batchgen.model.families.hf_config import config_from_hf
from batchgen.model.families.rope import rope_tables

# Factors far enough from each other that the tiny model's tokens show which set ran: the long
# ones raise every frequency tenfold, the short ones lower the slow ones.
LONGROPE = dict(
    original_max_position_embeddings=64,
    rope_scaling=dict(
        rope_type="longrope",
        short_factor=[1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
        long_factor=[0.1] * 8,
    ),
)
MODELS = {
    "default": {},
    # Phi-4-mini's 0.75 (12 of 16 features rotate) with a sliding window of 8
    "partial-window": dict(partial_rotary_factor=0.75, sliding_window=8),
    "longrope": LONGROPE,
    "longrope-partial": dict(
        partial_rotary_factor=0.75,
        original_max_position_embeddings=64,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[0.7] * 6,
            long_factor=[0.1 + 0.02 * i for i in range(6)],
        ),
    ),
}
DENSE = ("default", "partial-window")
LONG_NEW = 10
LONG_PARAMS = SamplingParams(max_new_tokens=LONG_NEW)
# chunks of <= 16 tokens, 3 rows at a time, 40 blocks of 4: long prompts in chunks, preemption
LONG_TIGHT = EngineConfig(
    max_num_seqs=3, max_num_batched_tokens=16, block_size=4, kv_cache_tokens=160
)


def _long_prompts() -> list[list[int]]:
    """Short rows; a row of 58 that grows past 64 (recomputed there); long rows; a prefix of 44
    shared by two long rows (a prefix hit) and a short one (which must not hit their blocks)."""
    (prefix,) = random_prompts([44], seed=7)
    shared = [prefix + p for p in random_prompts([30, 6, 25], seed=3)]
    growing = random_prompts([5, 20, 40, 58], seed=1)[3]
    return random_prompts([5, 20, 40]) + [growing] + random_prompts([66, 80, 100], seed=5) + shared


SHORT_ROWS, GROWING_ROW, LONG_ROWS, SHARED_SHORT_ROW = [0, 1, 2], 3, [4, 5, 6, 7, 9], 8


@pytest.fixture(scope="module")
def phi(hf_dirs):
    def get(name):
        return hf_dirs("phi3", **MODELS[name])

    return get


@pytest.fixture(scope="module")
def references(phi):
    """Dense models: transformers' batched generate; longrope: each row run alone."""

    def make(name):
        if name in DENSE:
            return hf_greedy(phi(name), _prompts(), MAX_NEW)
        return [hf_greedy(phi(name), [p], LONG_NEW)[0] for p in _long_prompts()]

    return cached(make)


def _generate(model_dir, engine=None, prompts=None, params=PARAMS, **options):
    llm = LLM(model_dir, dtype="float32", device="cpu", engine=engine, **options)
    return llm, [c.token_ids for c in llm.generate(prompts or _prompts(), params)]


def _long(model_dir, engine=None, **options):
    return _generate(model_dir, engine, _long_prompts(), LONG_PARAMS, **options)


@pytest.mark.parametrize("name", DENSE)
def test_greedy_equals_transformers(name, phi, references):
    llm, got = _generate(phi(name))
    assert llm.spec.model_cfg.impl == "native"  # auto: the native family
    assert got == references(name)
    llm, got = _generate(phi(name), TIGHT)
    assert got == references(name)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.pool.hits > 0


@pytest.mark.parametrize("name", ["longrope", "longrope-partial"])
def test_longrope_rows_each_equal_transformers_alone(name, phi, references):
    want = references(name)
    _, got = _long(phi(name))
    assert got == want
    llm, got = _long(phi(name), LONG_TIGHT)
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.pool.hits > 0
    assert all(len(row) == LONG_NEW for row in want)  # the growing row did pass 64


@pytest.mark.parametrize("change", [dict(sliding_window=None), dict(partial_rotary_factor=1.0)])
def test_without_the_window_or_the_partial_rotary_the_tokens_change(change, phi, references):
    """The model's config changed before its caches and RoPE tables are built."""
    llm = LLM(phi("partial-window"), dtype="float32", device="cpu")
    llm.model.cfg = dataclasses.replace(llm.model.cfg, **change)
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got != references("partial-window")


def test_longrope_controls_change_the_tokens(phi, references, monkeypatch):
    """Each half of the per-row choice matters on this model: the tokens change with the long
    factors for every row, with the short ones for every row, without the recompute of a row
    that grows past 64, and without the long rows' own prefix-cache salt."""
    d, want = phi("longrope"), references("longrope")

    def differ(rows):
        _, got = _long(d)
        return [i for i in rows if got[i] != want[i]]

    with monkeypatch.context() as m:
        m.setattr(LongRopeRows, "is_long", lambda self, n: True)
        assert differ(SHORT_ROWS + [SHARED_SHORT_ROW])
    with monkeypatch.context() as m:
        m.setattr(LongRopeRows, "is_long", lambda self, n: False)
        assert differ(LONG_ROWS)
    with monkeypatch.context() as m:
        m.setattr(Engine, "_recompute_grown_rows", lambda self, plan, rope: None)
        assert differ([GROWING_ROW]) == [GROWING_ROW]
    with monkeypatch.context() as m:  # no salt: the recomputed row hits its own short blocks
        unsalted = scheduler.block_hash
        m.setattr(
            scheduler, "block_hash", lambda parent, t: unsalted(None if parent == 1 else parent, t)
        )
        assert differ([GROWING_ROW]) == [GROWING_ROW]


@pytest.mark.slow
def test_compiled_decode_equals_transformers(phi, references):
    """The compiled decode reads the long rows' table rows (positions past 256) as eager does."""
    llm, got = _long(phi("longrope"), compile=True, compile_cache="off")
    assert got == references("longrope")
    assert llm.runner.shapes and llm.runner.graph.graphs <= 1 and not llm.runner.graph.failed


def test_tables_equal_transformers_rotary_embedding(phi):
    """Our cos/sin rows (short at p, long at P + p) are transformers' Phi3RotaryEmbedding's for
    a forward of p + 1 tokens, bit for bit, times its attention factor."""
    for name in ("longrope", "longrope-partial"):
        d = phi(name)
        cfg = LLM(d, device="cpu").spec.model_cfg
        emb = transformers.AutoModelForCausalLM.from_pretrained(d).model.rotary_emb
        cos, sin = rope_tables(256, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, "cpu")
        assert cos.shape == (512, cfg.rotary_dim)
        for n in (40, 64, 65, 200):  # a forward of n tokens: long above 64
            pos = torch.arange(n)[None]
            want_cos, want_sin = emb(torch.zeros(1, dtype=torch.float32), pos)
            row = torch.arange(n) + (256 if n > 64 else 0)
            assert torch.equal(cos[row], want_cos[0]) and torch.equal(sin[row], want_sin[0])


def test_native_equals_the_backend(phi):
    for name in DENSE:
        backend, got_backend = _generate(phi(name), TIGHT, model_impl="transformers")
        assert backend.spec.model_cfg.impl == "transformers"
        _, got_native = _generate(phi(name), model_impl="native")
        assert got_native == got_backend


def test_config_of_hub_phi3_configs():
    """Phi-3-mini-128k's layout (transformers 4: rope_scaling "longrope" with top-level
    original_max_position_embeddings) and Phi-4-mini's partial_rotary_factor; "su" is
    longrope's earlier name."""
    hf = decoder_config(
        "phi3",
        vocab=32064,
        hidden=3072,
        intermediate=8192,
        layers=32,
        heads=32,
        num_key_value_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling=dict(type="su", short_factor=[1.0] * 48, long_factor=[2.0] * 48),
        sliding_window=262144,
    )
    cfg = config_from_hf(hf)
    scaling = cfg.rope_scaling
    assert scaling.kind == "longrope" and scaling.original_max_position_embeddings == 4096
    assert scaling.attention_factor == pytest.approx(
        (1 + 5 * 0.6931471805599453 / 8.317766166719343) ** 0.5
    )
    assert cfg.long_rope == LongRopeRows(4096, 131072) and cfg.rotary_dim == 96
    mini = {
        **hf,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "partial_rotary_factor": 0.75,
    }
    mini["rope_scaling"] = dict(type="longrope", short_factor=[1.0] * 48, long_factor=[2.0] * 48)
    cfg = config_from_hf(mini)
    assert cfg.head_dim == 128 and cfg.rotary_dim == 96 and cfg.sliding_window == 262144
    with pytest.raises(Exception, match="short_factor must have 48 values"):
        config_from_hf(
            {
                **mini,
                "rope_scaling": dict(
                    type="longrope", short_factor=[1.0] * 64, long_factor=[2.0] * 48
                ),
            }
        )


def test_two_ranks_give_one_rank_tokens(phi):
    """q, k, v cut out of the fused qkv_proj by heads, gate and up out of gate_up_proj; the
    longrope rows (PROMPTS grow past 64) the same on each rank."""
    d = phi("longrope")
    ref = [c.token_ids for c in LLM(d, device="cpu", engine=TP_ENGINE).generate(PROMPTS, GREEDY)]
    with LLM(d, device="cpu", engine=TP_ENGINE, tensor_parallel_size=2) as llm:
        out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    _assert_tp_matches(d, ref, out)


def test_lora_on_the_fused_matrices_equals_peft_merge(phi, tmp_path):
    from peft import LoraConfig

    d = phi("default")
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    peft_model = make_adapter(d, tmp_path / "adapter", LoraConfig(r=4, target_modules=targets))
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    llm, got = _generate(d, lora=tmp_path / "adapter")
    assert llm.spec.model_cfg.impl == "native" and len(llm.spec.lora.merges) == 2 * 4
    assert got == hf_greedy(tmp_path / "merged", _prompts(), MAX_NEW)


def test_int8_quantizes_the_fused_matrices(phi):
    llm = LLM(phi("default"), device="cpu", quantize="int8", quant_backend="torchao")
    block = llm.model.layers[0]
    assert type(block.attn.wqkv.weight).__name__ == "Int8Tensor"
    assert type(block.mlp.w_in.weight).__name__ == "Int8Tensor"
    assert all(c.token_ids for c in llm.generate(_prompts(), PARAMS))


def test_cli_run_native_and_backend(phi, tmp_path):
    d = phi("longrope")
    src = prompt_file(tmp_path, 4)
    run_job(src, tmp_path / "native", d, "--max-new-tokens", 4)
    stats = read_stats(tmp_path / "native")
    assert stats["model_impl"] == "native" and stats["family"] == "phi3"
    run_job(src, tmp_path / "hf", d, "--max-new-tokens", 4, "--model-impl", "transformers")
    assert read_stats(tmp_path / "hf")["model_impl"] == "transformers"
