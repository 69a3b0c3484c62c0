"""The native MoE families (model/families/moe.py): Qwen3-MoE and Mixtral, token for token equal to
transformers' greedy generate under packed prefill, chunked prefill and prefix hits, equal to
the transformers backend, split over two tensor-parallel ranks, compiled, and through the CLI.
A control: without the top-k renormalisation the tokens change, so the equality is not luck.

The models are tests/tiny_hf_models.py's (4 experts, 2 a token, sharpened attention); one
Qwen3-MoE also renormalises its routing weights and has a dense layer (mlp_only_layers), and
one is saved in transformers' own layout (3-D gate_up_proj / down_proj per layer)."""

import json

import pytest
import torch
import transformers
from helpers import (
    assert_live_equal,
    assert_pressed,
    cached,
    cpu_llm,
    decoder_config,
    hf_greedy,
    make_adapter,
    prompt_file,
    read_stats,
    run_job,
    run_plan,
)
from test_compile import ENGINE as COMPILE_ENGINE
from test_compile import CompileEvents, _run, _same, _workload
from test_hf_backend import MAX_NEW, PARAMS, TIGHT, _prompts
from test_tensor_parallel_ranks import ENGINE as TP_ENGINE
from test_tensor_parallel_ranks import GREEDY, PROMPTS, _assert_tp_matches
from tiny_hf_models import save_tiny_hf_model

from batchgen.llm import LLM
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.families.hf_config import config_from_hf
from batchgen.model.families.moe import MoE, experts_dense, experts_grouped, experts_loop
from batchgen.model.parallel.sharding import TPShard

# name -> (model_type, config overrides)
MODELS = {
    "qwen3_moe": ("qwen3_moe", {}),  # norm_topk_prob false, every layer MoE
    "qwen3_moe-renorm-dense": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("mixtral", {}),
}
RENORMALISED = ("qwen3_moe-renorm-dense", "mixtral")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """name -> a tiny checkpoint directory, written at first use; "qwen3_moe-fused": the
    qwen3_moe one saved with its experts as 3-D tensors (save_original_format=False)."""

    def make(name):
        path = tmp_path_factory.mktemp(name)
        if name == "qwen3_moe-fused":
            hf = transformers.AutoModelForCausalLM.from_pretrained(get("qwen3_moe"))
            hf.save_pretrained(path, save_original_format=False)
            transformers.AutoTokenizer.from_pretrained(get("qwen3_moe")).save_pretrained(path)
        else:
            model_type, overrides = MODELS[name]
            save_tiny_hf_model(model_type, path, **overrides)
        return path

    get = cached(make)
    return get


@pytest.fixture(scope="module")
def references(moe_dirs):
    return cached(lambda name: hf_greedy(moe_dirs(name), _prompts(), MAX_NEW))


def _generate(model_dir, engine=None, **options):
    llm = cpu_llm(model_dir, engine=engine, **options)
    return llm, [c.token_ids for c in llm.generate(_prompts(), PARAMS)]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("engine", [None, TIGHT], ids=["packed", "chunked-preempted-hit"])
def test_greedy_equals_transformers(name, engine, moe_dirs, references):
    llm, got = _generate(moe_dirs(name), engine)
    assert llm.spec.model_cfg.impl == "native"  # auto: the native family
    assert any(isinstance(b.mlp, MoE) for b in llm.model.layers)
    assert_live_equal(got, references(name))
    if engine is TIGHT:
        assert_pressed(llm)


def test_a_dense_layer_among_moe_layers(moe_dirs):
    model = load_model(moe_dirs("qwen3_moe-renorm-dense"))
    assert [isinstance(b.mlp, MoE) for b in model.layers] == [True, False]
    assert model.cfg.norm_topk_prob and model.cfg.dense_layers == (1,)


def test_config_dense_layers_and_expert_counts():
    """Qwen3-MoE: a dense MLP where (i + 1) % decoder_sparse_step or i in mlp_only_layers;
    the hub's num_experts key or transformers 5's num_local_experts."""
    hf = decoder_config(
        "qwen3_moe",
        vocab=512,
        hidden=64,
        intermediate=128,
        layers=6,
        heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    cfg = config_from_hf(hf)
    assert cfg.dense_layers == (0, 2, 3, 4) and cfg.n_moe_layers == 2
    assert not cfg.norm_topk_prob and cfg.qk_norm
    attn = 64 * cfg.qkv_dim + 64 * 64
    moe = 8 * 64 + 8 * 3 * 64 * 32  # router, experts
    assert cfg.layer_params() == 6 * attn + 4 * 3 * 64 * 128 + 2 * moe
    assert cfg.active_layer_params == cfg.layer_params() - 2 * 6 * 3 * 64 * 32
    hf = {**hf, "num_local_experts": hf.pop("num_experts")}
    assert config_from_hf(hf).n_experts == 8


@pytest.mark.parametrize("name", RENORMALISED)
def test_without_the_top_k_renormalisation_the_tokens_change(name, moe_dirs, references):
    llm = cpu_llm(moe_dirs(name))
    for block in llm.model.layers:
        if isinstance(block.mlp, MoE):
            block.mlp.renorm = False
    got = [c.token_ids for c in llm.generate(_prompts(), PARAMS)]
    assert got != references(name)


def test_native_equals_the_backend(moe_dirs):
    d = moe_dirs("qwen3_moe")
    backend, got_backend = _generate(d, TIGHT, model_impl="transformers")
    assert backend.spec.model_cfg.impl == "transformers"
    _, got_native = _generate(d, model_impl="native")
    assert got_native == got_backend


def test_fused_and_per_expert_checkpoints_load_the_same(moe_dirs):
    per_expert, fused = (load_model(moe_dirs(n)) for n in ("qwen3_moe", "qwen3_moe-fused"))
    want = per_expert.state_dict()
    assert want["layers.0.mlp.w_in"].shape == (4, 2 * 32, 64)
    for name, w in fused.state_dict().items():
        assert torch.equal(w, want[name]), name
    # and each expert is the checkpoint's: its [gate; up] rows, its down
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs("qwen3_moe"))
    experts = hf.model.layers[1].mlp.experts
    assert torch.equal(want["layers.1.mlp.w_in"], experts.gate_up_proj)
    assert torch.equal(want["layers.1.mlp.w_out"], experts.down_proj)
    for r in range(2):  # and a rank's slices of each
        tp = TPShard(r, 2)
        per_expert, fused = (
            load_model(moe_dirs(n), tp=tp) for n in ("qwen3_moe", "qwen3_moe-fused")
        )
        for name, w in fused.state_dict().items():
            assert torch.equal(w, per_expert.state_dict()[name]), (r, name)


def test_ranks_hold_their_half_of_every_expert(moe_dirs):
    d = moe_dirs("qwen3_moe-renorm-dense")
    full = load_model(d).state_dict()
    shards = [load_model(d, tp=TPShard(r, 2)).state_dict() for r in range(2)]
    w_in = [s["layers.0.mlp.w_in"] for s in shards]  # (E, 2 x I/2, dim) each
    gate = torch.cat([w[:, :16] for w in w_in], dim=1)
    up = torch.cat([w[:, 16:] for w in w_in], dim=1)
    assert torch.equal(torch.cat([gate, up], dim=1), full["layers.0.mlp.w_in"])
    w_out = torch.cat([s["layers.0.mlp.w_out"] for s in shards], dim=2)
    assert torch.equal(w_out, full["layers.0.mlp.w_out"])
    for s in shards:  # the router replicated
        assert torch.equal(s["layers.0.mlp.router.weight"], full["layers.0.mlp.router.weight"])


@pytest.mark.parametrize("name", ["qwen3_moe-renorm-dense", "mixtral"])
def test_two_ranks_give_one_rank_tokens(name, moe_dirs):
    d = moe_dirs(name)
    ref = [c.token_ids for c in LLM(d, device="cpu", engine=TP_ENGINE).generate(PROMPTS, GREEDY)]
    with LLM(d, device="cpu", engine=TP_ENGINE, tensor_parallel_size=2) as llm:
        out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        assert llm.weights_bytes_per_rank < 0.6 * LLM(d, device="cpu").weights_bytes_per_rank
    _assert_tp_matches(d, ref, out)


def test_grouped_and_loop_kernels_agree():
    """The expert kernels (the op picks grouped on the CPU, the loop or dense elsewhere): the
    same values, empty experts included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g)
    w_in, w_out = torch.randn(4, 64, 64, generator=g), torch.randn(4, 64, 32, generator=g)
    experts = torch.tensor([[0, 2]] * 5 + [[2, 3]] * 4)  # expert 1 gets no token
    weights = torch.rand(9, 2, generator=g)
    args = (x, w_in, w_out, weights, experts, "silu")
    want = experts_loop(*args)
    torch.testing.assert_close(experts_grouped(*args), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts_dense(*args), want, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_compiled_equals_eager_with_no_recompile(moe_dirs):
    """One graph over a symbolic batch with the experts as an opaque op; the same job again
    compiles nothing."""
    d = moe_dirs("qwen3_moe-renorm-dense")
    eager = cpu_llm(d, engine=COMPILE_ENGINE)
    _, want = _run(eager, _workload())
    llm = cpu_llm(d, compile=True, compile_cache="off", engine=COMPILE_ENGINE)
    _, got = _run(llm, _workload())
    _same(got, want)
    decode = llm.runner.graph
    assert decode.graphs <= 1 and not decode.failed
    with CompileEvents() as events, torch._dynamo.config.patch(error_on_recompile=True):
        _, again = _run(llm, _workload())
    assert events.n == 0 and again == got and decode.graphs <= 1


def test_cli_run_plan_native_and_backend(moe_dirs, tmp_path):
    d = moe_dirs("qwen3_moe")
    src = prompt_file(tmp_path, 4)
    run_job(src, tmp_path / "native", d, "--max-new-tokens", 4)
    stats = read_stats(tmp_path / "native")
    assert stats["model_impl"] == "native" and stats["family"] == "qwen3_moe"
    # FLOPs count a token's 2 experts of 4 and the router; memory every expert
    cfg = cpu_llm(d).spec.model_cfg
    head = cfg.vocab_size * cfg.dim
    assert stats["model_flops_per_token"] == 2 * (cfg.active_layer_params + head)
    assert cfg.active_layer_params < cfg.layer_params()
    plan = json.loads(run_plan(src, d, "--json", "--dtype", "float32").stdout)
    assert plan["model_impl"] == "native"
    assert plan["weights_bytes_per_rank"] == 4 * cfg.num_params
    run_job(src, tmp_path / "hf", d, "--max-new-tokens", 4, "--model-impl", "transformers")
    assert read_stats(tmp_path / "hf")["model_impl"] == "transformers"


def test_quantize_takes_attention_and_keeps_the_experts(moe_dirs):
    llm = LLM(moe_dirs("qwen3_moe"), device="cpu", quantize="int8", quant_backend="torchao")
    block = llm.model.layers[0]
    assert type(block.attn.wqkv.weight).__name__ == "Int8Tensor"
    assert type(block.mlp.w_in) is torch.nn.Parameter and block.mlp.w_in.dtype == torch.float32
    assert llm.quant.to_dict()["unquantized"] == ["layers.0.mlp", "layers.1.mlp"]
    assert all(c.token_ids for c in llm.generate(_prompts(), PARAMS))


def test_an_attention_lora_merges_and_an_expert_lora_is_refused(moe_dirs, tmp_path):
    from peft import LoraConfig

    from batchgen.model.checkpoint.lora import LoraError

    d = moe_dirs("qwen3_moe")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    peft_model = make_adapter(d, tmp_path / "attn", config)
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    got = cpu_llm(d, lora=tmp_path / "attn").generate(_prompts(), PARAMS)
    assert [c.token_ids for c in got] == hf_greedy(tmp_path / "merged", _prompts(), MAX_NEW)
    # peft adapts transformers' 3-D experts as parameters, which no merge here takes
    make_adapter(d, tmp_path / "experts", LoraConfig(r=4, target_modules=["gate_proj", "up_proj"]))
    with pytest.raises(LoraError, match="parameter targets"):
        LLM(d, device="cpu", lora=tmp_path / "experts")


def test_num_params_counts_every_expert(moe_dirs):
    for name in MODELS:
        d = moe_dirs(name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d)
        want = sum(p.numel() for n, p in hf.named_parameters() if "norm" not in n)
        assert cpu_llm(d).spec.model_cfg.num_params == want, name
