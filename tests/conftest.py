import json
import os
from pathlib import Path

import pytest
import torch
from helpers import cached, make_adapter
from quant_checkpoints import block_fp8, compress, modelopt_fp8
from tiny_hf_models import save_tiny_hf_model
from tiny_models import FAMILIES, SHARPEN, save_tiny_model

# Tiny test models gain nothing from a second thread, and a busy machine stalls it.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _no_peak_probe(tmp_path_factory):
    """No run measures the CPU's peaks (a second each) or reads the user's cached ones: MFU
    and MBU are left out unless a test passes peaks or probes on purpose (test_metrics.py)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("BATCHGEN_NO_PEAK_PROBE", "1")
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test compiles as a fresh process would. Every engine compiles the same code object
    (`Transformer.hidden`), and dynamo keeps at most 8 guarded graphs a code object: a test
    worker that has compiled eight other tests' models would see the ninth fall back to eager
    (its test then fails on `graph.failed`, as three of test_quant's did in a full run). Not
    for GPU tests, whose module-scoped engines count CUDA graphs across their tests."""
    import sys

    if "torch._dynamo" in sys.modules and request.node.get_closest_marker("gpu") is None:
        torch._dynamo.reset()
    yield


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """(model_type, **config overrides) -> a tiny sharpened checkpoint of tiny_hf_models.py
    (a family or a multimodal wrapper), written at first use."""

    def make(key: str) -> Path:
        model_type, overrides = json.loads(key)
        return save_tiny_hf_model(model_type, tmp_path_factory.mktemp(model_type), **overrides)

    made = cached(make)
    return lambda model_type, **overrides: made(json.dumps([model_type, overrides], sort_keys=True))


@pytest.fixture(scope="session")
def ct_dirs(hf_dirs, tmp_path_factory):
    """a scheme of quant_checkpoints' CT_SCHEMES or CT_INT4 (skipped without
    compressed-tensors), "block-fp8" or "modelopt-fp8" -> the sharpened tiny Llama (hidden 64)
    stored as it."""
    root = tmp_path_factory.mktemp("stored")

    def make(name: str):
        if name == "block-fp8":
            return block_fp8(hf_dirs("llama"), root / name)
        if name == "modelopt-fp8":
            return modelopt_fp8(hf_dirs("llama"), root / name)
        pytest.importorskip("compressed_tensors")
        return compress(hf_dirs("llama"), root / name, name)

    return cached(make)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per supported family, saved with transformers."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def sharp_dirs(tmp_path_factory) -> dict[str, Path]:
    """The tiny models with peaked attention (tiny_models.sharpen_attention), one per family
    and "mistral-window4" (a 4-token sliding window): the exactness tests' models, on which
    a missing feature changes the greedy tokens (test_exactness_controls.py)."""
    root = tmp_path_factory.mktemp("sharp")
    dirs = {f: save_tiny_model(f, root / f, sharpen=SHARPEN) for f in FAMILIES}
    window = save_tiny_model("mistral", root / "window4", sharpen=SHARPEN, sliding_window=4)
    return {**dirs, "mistral-window4": window}


@pytest.fixture(scope="session")
def model(tiny_dirs) -> Path:
    """The tiny Llama: the model most tests run."""
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def lora_dir(tiny_dirs, tmp_path_factory) -> Path:
    """A PEFT LoRA adapter (r 4, every linear layer) on the tiny Llama."""
    from peft import LoraConfig

    d = tmp_path_factory.mktemp("lora") / "adapter"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    make_adapter(tiny_dirs["llama"], d, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    return d


@pytest.fixture(scope="session")
def gpt2(tiny_dirs) -> Path:
    """The tiny GPT-2 (learned positions, LayerNorm, fused c_attn)."""
    return tiny_dirs["gpt2"]


@pytest.fixture(scope="session")
def one_kv_head(tmp_path_factory) -> Path:
    """A Llama with one KV head: at 2 tensor-parallel ranks each holds it (replicated)."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("kv1") / "llama", num_key_value_heads=1)


@pytest.fixture(scope="session")
def window_dir(tmp_path_factory) -> Path:
    """Mistral with a 4-token sliding window, so short rows exercise the window masks."""
    return save_tiny_model("mistral", tmp_path_factory.mktemp("sw") / "m", sliding_window=4)


def pytest_runtest_logreport(report) -> None:
    """With BATCHGEN_INSTAFAIL=1 (scripts/gpu_check.sh), a failure's traceback is printed when
    it happens: a run stopped by its time limit never reaches pytest's closing summary."""
    if report.failed and os.environ.get("BATCHGEN_INSTAFAIL"):
        print(f"\n{report.nodeid} ({report.when}) FAILED:\n{report.longreprtext}", flush=True)


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (make test: -n 2 --dist loadgroup) the Slurm tests share one worker:
    # they start and use the machine's one Slurm cluster.
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("slurm"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run scripts/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """body -> an `sbatch` first on PATH: a shell script that reads the batch script from its
    stdin and runs body (`echo 4242`: a job id; `exit 1`: a refused submit)."""

    def make(body: str) -> None:
        bin_dir = tmp_path / "fake-bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "sbatch").write_text(f"#!/bin/sh\ncat > /dev/null\n{body}\n")
        (bin_dir / "sbatch").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    return make


@pytest.fixture(scope="session")
def long_model(tmp_path_factory) -> Path:
    """A tiny Llama with 2048 positions, for rows longer than the default 256."""
    root = tmp_path_factory.mktemp("long") / "llama"
    return save_tiny_model("llama", root, max_position_embeddings=2048)


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory) -> Path:
    """A tiny Llama whose config allows 2**24 positions (RoPE: no weights depend on it), for
    a KV cache sized from the job beyond any memory."""
    root = tmp_path_factory.mktemp("long-context") / "llama"
    return save_tiny_model("llama", root, max_position_embeddings=2**24)


@pytest.fixture(scope="session")
def wide_vocab_model(tmp_path_factory) -> Path:
    """A tiny Llama with a 32k vocabulary and 32k positions: a long prompt's full logits would
    be gigabytes (the prompt-logprobs memory test)."""
    root = tmp_path_factory.mktemp("wide-vocab") / "llama"
    return save_tiny_model("llama", root, vocab_size=32000, max_position_embeddings=32768)
