"""Native Gemma 2 and Gemma 3 (model/families/gemma.py): greedy float32 tokens equal to
transformers' generate on tiny sharpened models (soft-caps of 1 and 0.5, windows of 8 tokens,
prompts up to 25 long) under packed and chunked prefill, preemption and prefix hits; equal to the
transformers backend; compiled decode equal to eager; two tensor-parallel ranks equal to one.
Controls: the tokens change without each Gemma feature, so the equality is not luck."""

import dataclasses

import pytest
import torch
import transformers
from helpers import (
    assert_live_equal,
    assert_pressed,
    cached,
    decoder_config,
    hf_generate,
    hf_greedy,
    make_adapter,
    prompt_file,
    random_prompts,
    read_stats,
    rows_by_id,
    run_job,
)
from test_hf_backend import MAX_NEW, PARAMS, TIGHT

from batchgen.engine.config import EngineConfig
from batchgen.llm import LLM
from batchgen.model.attention.sdpa import AttnParams
from batchgen.model.attention.step import DECODE_ATTENTION_ENV, DecodeBackend
from batchgen.model.config import Family, RopeScaling
from batchgen.model.families.gemma import GemmaRMSNorm, GemmaTransformer
from batchgen.model.families.hf_config import config_from_hf
from batchgen.model.families.rope import rope_tables
from batchgen.model.families.transformer import RMSNorm

# Gemma 3's sliding layers rotate with a base of 10 (the default 10000 and the global 1e6 turn
# alike over an 8-token window: the base would not show); "-linear": its global layers' RoPE
# (base 100) linearly scaled by 8.
LOCAL = {"rope_type": "default", "rope_theta": 10.0}
ROPE = dict(rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": LOCAL})
LINEAR = dict(
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100.0},
        "sliding_attention": LOCAL,
    }
)
MODELS = {
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", ROPE),
    "gemma3-linear": ("gemma3_text", LINEAR),
}


def _prompts() -> list[list[int]]:
    """test_hf_backend's, a prefixed row longer (25): three windows of 8."""
    (prefix,) = random_prompts([13], seed=7)
    return random_prompts([3, 11, 6, 17, 1]) + [prefix + p for p in random_prompts([2, 5, 12], 1)]


@pytest.fixture(scope="module")
def gemma(hf_dirs):
    """name of MODELS -> its checkpoint directory."""
    return lambda name: hf_dirs(MODELS[name][0], **MODELS[name][1])


@pytest.fixture(scope="module")
def reference(gemma):
    return cached(lambda name: hf_greedy(gemma(name), _prompts(), MAX_NEW))


def _generate(model_dir, engine=None, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model_dir, dtype="float32", device="cpu", engine=engine, **options)
    return llm, [c.token_ids for c in llm.generate(_prompts(), PARAMS)]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("engine", [None, TIGHT], ids=["packed", "chunked-preempted-prefix"])
def test_native_greedy_equals_transformers(name, engine, gemma, reference):
    llm, got = _generate(gemma(name), engine)
    assert llm.spec.model_cfg.impl == "native" and isinstance(llm.model, GemmaTransformer)
    assert_live_equal(got, reference(name))
    if engine is TIGHT:
        assert_pressed(llm)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_native_equals_the_backend(name, gemma):
    _, native = _generate(gemma(name), TIGHT)
    backend, got = _generate(gemma(name), model_impl="transformers")
    assert backend.spec.model_cfg.impl == "transformers" and got == native


def _dropped(llm: LLM, feature: str, monkeypatch) -> None:
    """llm's model without one Gemma feature."""
    model = llm.model
    cfg = model.cfg
    for block in model.layers:
        attn = block.attn
        if feature == "attention soft-cap":
            monkeypatch.setattr(attn, "params", AttnParams(cfg.attn_scale))
        if feature == "attention scale":
            monkeypatch.setattr(attn, "params", AttnParams(None, cfg.attn_softcap))
    if feature == "(1 + w) norm":  # Llama's: w
        monkeypatch.setattr(GemmaRMSNorm, "forward", RMSNorm.forward)
    if feature == "window":
        monkeypatch.setattr(model, "windows", (None,) * cfg.n_layers)
    if feature == "local rope base":  # the sliding layers rotated as the global ones
        monkeypatch.setattr(model, "local_cos", model.rope_cos)
        monkeypatch.setattr(model, "local_sin", model.rope_sin)
    if feature == "rope scaling":  # the global layers' tables unscaled
        n, d = cfg.max_position_embeddings, cfg.head_dim
        cos, sin = rope_tables(n, d, cfg.rope_theta, RopeScaling(), torch.device("cpu"))
        monkeypatch.setattr(model, "rope_cos", cos)
        monkeypatch.setattr(model, "rope_sin", sin)


@pytest.mark.parametrize(
    "name, feature",
    [
        ("gemma2", "attention soft-cap"),
        ("gemma2", "attention scale"),
        ("gemma2", "window"),
        ("gemma2", "(1 + w) norm"),
        ("gemma3", "window"),
        ("gemma3", "local rope base"),
        ("gemma3", "(1 + w) norm"),
        ("gemma3-linear", "rope scaling"),
    ],
)
def test_without_a_feature_the_tokens_change(name, feature, gemma, reference, monkeypatch):
    llm = LLM(gemma(name), dtype="float32", device="cpu")
    llm.generate(_prompts()[:1], PARAMS)  # the cache and RoPE tables are set up by a first job
    _dropped(llm, feature, monkeypatch)
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got != reference(name)


def test_logprobs_follow_the_final_soft_cap(gemma, monkeypatch):
    """The cap (3) is monotonic, so greedy tokens cannot show it: the logprobs do. Each row's
    logprobs equal transformers' log-softmax of its capped logits; uncapped, they do not."""
    d = gemma("gemma2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, dtype="float32", device="cpu")

    def logprobs() -> list[torch.Tensor]:
        return [torch.tensor(c.logprobs) for c in llm.generate(_prompts(), PARAMS)]

    got = logprobs()
    with torch.inference_mode():
        for prompt, c, lp in zip(_prompts(), llm.generate(_prompts(), PARAMS), got, strict=True):
            ids = torch.tensor([prompt + c.token_ids])
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            want = logits.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)
    cfg = llm.model.cfg
    monkeypatch.setattr(llm.model, "cfg", dataclasses.replace(cfg, final_softcap=None))
    uncapped = logprobs()
    assert max((a - b).abs().max() for a, b in zip(got, uncapped, strict=True)) > 0.1


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_flex_decode_equals_transformers(name, gemma, reference, monkeypatch):
    """CUDA's decode path, FlexAttention over the pool in place (eager here: exact for every
    key), takes the layers' scale and soft-cap, and each layer's window in its mask."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flex")
    llm, got = _generate(gemma(name), EngineConfig(block_size=16))
    assert llm.runner.attention is DecodeBackend.FLEX and got == reference(name)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gather", "flex"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_compiled_decode_equals_transformers(name, attention, gemma, reference, monkeypatch):
    """One graph over a symbolic batch; the decode op takes each layer's scale, soft-cap and
    window, and the sliding layers their own RoPE table."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, attention)
    opts = dict(compile=True, compile_cache="off")
    llm, got = _generate(gemma(name), EngineConfig(block_size=16), **opts)
    assert got == reference(name)
    assert llm.runner.shapes and llm.runner.graph.graphs <= 1 and not llm.runner.graph.failed


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_two_tensor_parallel_ranks_equal_transformers(name, gemma, reference):
    """Heads and the MLP split as Llama's (gloo on the CPU), the norms replicated, the final
    soft-cap on the gathered logits."""
    with LLM(gemma(name), dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got == reference(name)


def test_cli_runs_a_gemma3_wrapper_natively_as_the_backend_does(hf_dirs, tmp_path):
    d = hf_dirs("gemma3")
    src = prompt_file(tmp_path, 4)
    tokens = {}
    for impl in ("auto", "transformers"):
        out = tmp_path / impl
        run_job(src, out, d, "--max-new-tokens", 6, "--with-token-ids", "--model-impl", impl)
        stats = read_stats(out)
        assert stats["family"] == "gemma3"
        assert stats["model_impl"] == ("native" if impl == "auto" else "transformers")
        tokens[impl] = [r["token_ids"] for _, r in sorted(rows_by_id(out).items())]
    assert tokens["auto"] == tokens["transformers"]


def test_config_json_of_transformers_4_reads_as_transformers_5_does():
    """rope_theta, rope_local_base_freq, the global layers' rope_scaling and
    sliding_window_pattern (Gemma 3 as saved by transformers 4), Gemma 2 without layer_types."""
    old = decoder_config(
        "gemma3_text",
        vocab=512,
        hidden=64,
        intermediate=128,
        layers=8,
        heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
        sliding_window=512,
        query_pre_attn_scalar=16,
    )
    cfg = config_from_hf(old)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    windows = [512 if t == "sliding_attention" else None for t in hf.layer_types]
    assert list(cfg.layer_windows) == windows and None in windows and cfg.sliding_window is None
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
    )
    assert cfg.local_rope_theta == local["rope_theta"] == 20000.0
    assert cfg.attn_scale == 0.25 and cfg.attn_softcap is None and cfg.tie_embeddings

    gemma2 = {**old, "model_type": "gemma2", "num_hidden_layers": 3}
    for key in ("rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        del gemma2[key]
    cfg = config_from_hf(gemma2)
    assert cfg.family == Family.GEMMA2 and cfg.layer_windows == (512, None, 512)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)  # Gemma2Config's defaults
    assert cfg.local_rope_theta is None


def test_int8_and_lora_load_natively(gemma, reference, tmp_path):
    """The decoder's linears are Llama's (wqkv, wo, w_in, w_out): quantization and the LoRA
    merge find them."""
    from peft import LoraConfig

    d = gemma("gemma2")
    llm = LLM(d, dtype="float32", device="cpu", quantize="int8")
    assert llm.spec.model_cfg.impl == "native" and llm.generate(_prompts()[:1], PARAMS)
    targets = ["q_proj", "v_proj", "down_proj"]
    peft = make_adapter(d, tmp_path / "adapter", LoraConfig(r=4, target_modules=targets))
    merged = peft.merge_and_unload().eval()
    rows = hf_generate(merged, _prompts(), MAX_NEW, pad=1)
    want = [r[: r.index(1) + 1] if 1 in r else r for r in rows]  # EOS 1
    _, got = _generate(d, lora=tmp_path / "adapter")
    assert got == want and want != reference("gemma2")


def test_the_mlp_activation_is_torchs_tanh_gelu_bit_for_bit(gemma):
    """gelu_pytorch_tanh is torch's fused kernel, not GPT-2's written-out gelu_new (which
    differs in the last bits and ran the MLP slower)."""
    from transformers.activations import ACT2FN

    from batchgen.model.families.activations import activation

    llm = LLM(gemma("gemma2"), dtype="float32", device="cpu")
    name = llm.spec.model_cfg.activation
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(activation(name, x), ACT2FN["gelu_pytorch_tanh"](x))
    assert not torch.equal(activation("gelu_tanh", x), ACT2FN["gelu_pytorch_tanh"](x))
