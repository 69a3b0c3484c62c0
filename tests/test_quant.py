"""Weight-only quantization: schemes, fidelity to the float model, compiled steady state.

Fidelity bounds are relative L2 errors of the logits, (q - f).norm() / f.norm(), on the
tiny random models (width 32, int4 in groups of 32), measured on torch 2.13 CPU over the
five families, with the largest value seen:

    int8 <= 1%   (measured max 0.5%, qwen3)
    fp8  <= 4%   (measured max 2.0%, qwen3)
    int4 <= 12%  (measured max 7.1%, qwen3)

The compiled tests build a decode graph per decode shape (two here) and are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_llm, graph_launches
from paged import last_logits
from tiny_models import FAMILIES, save_tiny_model
from torch._dynamo.utils import counters

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.errors import QuantUnavailableError
from batchgen.llm import LLM
from batchgen.model.checkpoint.loader import load_model
from batchgen.quant import (
    QuantScheme,
    available,
    default_backend,
    make_scheme,
    quantize_model,
    tensor_bytes,
)
from batchgen.quant.scheme import TARGETS

BOUNDS = {"int8": 0.01, "fp8": 0.04, "int4": 0.12}
CPU_PATHS = [(b, m) for b in ("torchao", "quanto") for m in ("int8", "int4", "fp8")]
# the paths through LLM.generate (the engine)
LLM_PATHS = CPU_PATHS
ENGINE = EngineConfig(max_num_seqs=4, kv_cache_tokens=512)


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Last-position logits of a full forward over tokens (B, T): one packed prefill step."""
    return last_logits(model, tokens.tolist())


def rel_err(q: torch.Tensor, f: torch.Tensor) -> float:
    return float((q - f).norm() / f.norm())


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny Llama 128 wide, so int4's default group size of 128 divides every layer."""
    return save_tiny_model(
        "llama",
        tmp_path_factory.mktemp("quant") / "llama128",
        hidden_size=128,
        intermediate_size=256,
    )


def _quantized(model_dir, backend: str, method: str, compile: bool = False) -> LLM:
    return cpu_llm(
        model_dir, compile=compile, engine=ENGINE, quantize=method, quant_backend=backend
    )


# --------------------------------------------------------------------------- schemes


def test_scheme_validation_and_record():
    s = QuantScheme("int4", "quanto", 64)
    assert s.method.value == "int4" and s.backend.value == "quanto"
    assert s.to_dict()["group_size"] == 64
    assert s.to_dict()["modules"] == [f"layers.*.{t}" for t in TARGETS]
    assert QuantScheme().to_dict() == {"method": "none"}
    with pytest.raises(ValueError, match="group_size"):
        QuantScheme("int4", "torchao", 48)
    with pytest.raises(ValueError, match="int4 only"):
        QuantScheme("int8", "torchao", 128)
    with pytest.raises(ValueError, match="needs a backend"):
        QuantScheme("int8")
    with pytest.raises(ValueError):
        QuantScheme("int3", "torchao")


def test_make_scheme_resolves_auto_and_defaults():
    assert default_backend("cpu").value == "torchao"
    assert default_backend("cuda").value == "torchao"
    assert make_scheme("int8", "auto", "cpu", torch.float32).backend.value == "torchao"
    # torchao's CPU int4 kernel is fast only with bf16 activations (measured)
    s = make_scheme("int4", "auto", "cpu", torch.float32)
    assert s.backend.value == "quanto" and s.group_size == 128
    assert make_scheme("int4", "auto", "cpu", torch.bfloat16).backend.value == "torchao"
    assert make_scheme("none", "quanto").to_dict() == {"method": "none"}


def test_unavailable_combination_names_the_available_ones():
    with pytest.raises(QuantUnavailableError) as e:
        make_scheme("int4", "quanto", "cpu", torch.bfloat16)
    msg = str(e.value)
    assert "quanto" in msg and "bfloat16" in msg and "torchao int4" in msg
    assert "quanto int4 (float32/float16 only)" in available("cpu")
    # the same on CUDA: measured failing to compile on an H200
    with pytest.raises(QuantUnavailableError, match="torchao int4"):
        make_scheme("int4", "quanto", "cuda", torch.bfloat16)
    assert "quanto int4 (float32/float16 only)" in available("cuda")


def test_int4_picks_per_layer_the_largest_group_size_that_divides(tiny_dirs):
    # hidden 32, intermediate 64: the default 128 divides no layer of this model
    scheme = quantize_model(
        load_model(tiny_dirs["llama"]), QuantScheme("int4", "torchao", 128), "cpu"
    )
    assert dict(scheme.layer_group_sizes) == {
        "attn.wqkv": 32,
        "attn.wo": 32,
        "mlp.w_in": 32,
        "mlp.w_out": 64,
    }
    d = scheme.to_dict()
    assert d["group_size"] == 128 and d["granularity"] == "groups of 32/64"
    assert d["group_sizes"]["layers.*.mlp.w_out"] == 64
    # the requested size is the largest any layer gets
    capped = quantize_model(
        load_model(tiny_dirs["llama"]), QuantScheme("int4", "quanto", 32), "cpu"
    )
    assert set(dict(capped.layer_group_sizes).values()) == {32}
    assert capped.to_dict()["granularity"] == "group of 32"


def test_int4_refuses_a_model_no_layer_of_which_a_group_size_divides(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m", hidden_size=48, intermediate_size=200)
    with pytest.raises(QuantUnavailableError, match=r"attn\.wqkv: 48.*mlp\.w_out: 200.*int8"):
        quantize_model(load_model(path), QuantScheme("int4", "torchao", 128), "cpu")


# --------------------------------------------------------------------------- fidelity


@pytest.mark.parametrize(("backend", "method"), CPU_PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_float(tiny_dirs, family, backend, method):
    tokens = torch.randint(2, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    ref = logits(load_model(tiny_dirs[family]), tokens)
    model = load_model(tiny_dirs[family])
    scheme = quantize_model(
        model, QuantScheme(method, backend, 32 if method == "int4" else None), "cpu"
    )
    assert scheme.weight_format not in (None, "Tensor", "Parameter")
    err = rel_err(logits(model, tokens), ref)
    assert err <= BOUNDS[method], f"{family} {backend} {method}: {err:.4f}"
    assert err > 0, "weights were not quantized"


@pytest.mark.parametrize(("backend", "method"), CPU_PATHS)
def test_quantized_weights_are_smaller_and_tie_kept(tiny_dirs, backend, method):
    model = load_model(tiny_dirs["gpt2"])  # tied lm_head
    before = {n: tensor_bytes(model.layers[0].get_submodule(n).weight) for n in TARGETS}
    quantize_model(model, QuantScheme(method, backend, 32 if method == "int4" else None), "cpu")
    # float32 -> 1 byte per weight (+ scales), or 0.5 (+ scales and zero points per 32)
    limit = 0.3 if method != "int4" else 0.2
    for n in TARGETS:
        assert tensor_bytes(model.layers[0].get_submodule(n).weight) <= limit * before[n], n
    assert model.lm_head.weight is model.embed.weight
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(("backend", "method"), LLM_PATHS)
def test_llm_records_the_scheme(wide_dir, backend, method):
    llm = _quantized(wide_dir, backend, method)
    d = llm.quant.to_dict()
    assert (d["method"], d["backend"]) == (method, backend)
    assert d["group_size"] == (128 if method == "int4" else None)
    assert d["weight_format"] == type(llm.model.layers[0].attn.wqkv.weight).__name__
    out = llm.generate(prompts(), SamplingParams(max_new_tokens=4))
    assert all(len(c.token_ids) == 4 for c in out)


def test_llm_unquantized_records_none(wide_dir):
    llm = cpu_llm(wide_dir, engine=ENGINE)
    assert llm.quant.to_dict() == {"method": "none"}


# --------------------------------------------------------------------------- compiled


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "method"), LLM_PATHS)
def test_compiled_generation_has_no_recompiles(wide_dir, backend, method):
    """fullgraph=True compile (the runner's setting) of the quantized model: one graph of
    the model for every step, prefills and decodes, and later batches of other token counts
    compile nothing."""
    llm = _quantized(wide_dir, backend, method, compile=True)
    eager = _quantized(wide_dir, backend, method)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = llm.generate(prompts(0), params)
    shapes = set(llm.runner.shapes)
    assert llm.runner.graph.graphs <= 1 and shapes and not llm.runner.graph.failed
    warm = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2, 3):
            llm.generate(prompts(seed), params)
    assert counters["stats"]["unique_graphs"] == warm and llm.runner.shapes >= shapes
    # Compiled and eager run the same quantized kernels: greedy tokens agree.
    ref = eager.generate(prompts(0), params)
    same = sum(
        a == b
        for c, r in zip(first, ref, strict=True)
        for a, b in zip(c.token_ids, r.token_ids, strict=True)
    )
    assert same >= 0.9 * 4 * 8, (same, [c.token_ids for c in first], [c.token_ids for c in ref])


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_quantized_decode_keeps_cuda_graphs(wide_dir):
    """The default CUDA backend's int8 decode runs as CUDA graphs, and steady state
    compiles nothing."""
    from torch._inductor import cudagraph_trees

    counters.clear()
    llm = LLM(
        wide_dir, dtype="bfloat16", device="cuda", compile=True, engine=ENGINE, quantize="int8"
    )
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    llm.generate(prompts(0), params)
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and sum(len(n) for n in manager.roots.values()) >= 1
    graphs = counters["stats"]["unique_graphs"]

    def again():
        with torch._dynamo.config.patch(error_on_recompile=True):
            llm.generate(prompts(1), params)

    # piecewise CUDA graphs: at least 2 launches a step (8 new tokens: 8 steps and more)
    assert graph_launches(again) >= 2 * 8
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "method"), [("torchao", "fp8"), ("torchao", "int4"), ("torchao", "int8")]
)
def test_gpu_bf16_logits_close_to_float(wide_dir, backend, method):
    """bf16 on CUDA: torchao fp8, int4 and int8 as close to the float logits as the same
    scheme in float32 on the CPU, plus bf16 rounding. (This 128-wide model's int4 error is
    0.149 in float32 on the CPU and 0.151 in bf16 on an H200, both backends alike: above
    BOUNDS' 0.12, which the smaller families meet, so the CPU figure is the reference.)"""
    tokens = torch.randint(2, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    cpu_ref = logits(load_model(wide_dir, torch.float32, "cpu"), tokens)
    cpu = load_model(wide_dir, torch.float32, "cpu")
    quantize_model(cpu, make_scheme(method, backend, "cpu", torch.float32), "cpu")
    cpu_err = rel_err(logits(cpu, tokens), cpu_ref)
    tokens = tokens.cuda()
    ref = logits(load_model(wide_dir, torch.bfloat16, "cuda"), tokens).float()
    model = load_model(wide_dir, torch.bfloat16, "cpu")
    scheme = quantize_model(model, make_scheme(method, backend, "cuda", torch.bfloat16), "cuda")
    print(scheme.to_dict(), cpu_err)
    err = rel_err(logits(model, tokens).float(), ref)
    assert err <= cpu_err + 0.02, f"{backend} {method}: {err:.4f} (CPU float32 {cpu_err:.4f})"


@pytest.mark.gpu
def test_gpu_quantizing_never_holds_the_float_model(tmp_path):
    """Peak CUDA memory while building a quantized LLM stays below the float weights'
    size: the pass moves and quantizes one block at a time (16 blocks here, so a full
    float copy would stand out well above the quantized model plus one float block)."""
    path = save_tiny_model(
        "llama", tmp_path / "deep", hidden_size=128, intermediate_size=256, num_hidden_layers=16
    )
    float_model = load_model(path, torch.bfloat16, "cpu")
    float_bytes = sum(tensor_bytes(p) for p in float_model.parameters())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    llm = LLM(path, dtype="bfloat16", device="cuda", compile=False, engine=ENGINE, quantize="int8")
    # the KV pool is allocated at the first step (none has run): any held so far counts off
    kv = sum(c.k.numel() * c.k.element_size() * 2 for c in llm.model.kv_caches if c is not None)
    peak = torch.cuda.max_memory_allocated() - base - kv
    assert peak < float_bytes, (peak, float_bytes)
