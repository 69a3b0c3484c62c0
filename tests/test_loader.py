"""Loading Hugging Face checkpoint directories: layouts, refusals, config variants, dtypes."""

import json
import shutil

import pytest
import torch
import transformers
from paged import last_logits
from test_exactness import hf_greedy
from tiny_models import save_tiny_model

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.checkpoint.loader import load_model
from batchgen.model.config import RopeScaling
from batchgen.model.families.hf_config import (
    SUPPORTED_FAMILIES,
    ModelLoadError,
    UnsupportedModelError,
    config_from_hf,
)

ENGINE = EngineConfig(max_num_seqs=4)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # tiny, so the scaling bends real wavelengths
    "rope_theta": 10000.0,
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in (7, 19, 2)]


def _greedy(path, dtype="float32") -> list[list[int]]:
    llm = LLM(path, dtype=dtype, device="cpu", compile=False, engine=ENGINE)
    return [c.token_ids for c in llm.generate(_prompts(), SamplingParams(max_new_tokens=10))]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _hf(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _copy_config_and_tokenizer(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    return dst


def test_weights_land_where_transformers_has_them(tiny_dirs):
    llama, hf = load_model(tiny_dirs["llama"]), _hf(tiny_dirs["llama"])
    a = hf.model.layers[1].self_attn
    qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    assert torch.equal(llama.layers[1].attn.wqkv.weight, qkv)
    m = hf.model.layers[0].mlp
    assert torch.equal(
        llama.layers[0].mlp.w_in.weight, torch.cat([m.gate_proj.weight, m.up_proj.weight])
    )
    assert torch.equal(llama.layers[0].mlp.w_out.weight, m.down_proj.weight)

    gpt2, hf = load_model(tiny_dirs["gpt2"]), _hf(tiny_dirs["gpt2"])
    h = hf.transformer.h[1]
    assert torch.equal(gpt2.layers[1].attn.wqkv.weight, h.attn.c_attn.weight.t())  # Conv1D
    assert torch.equal(gpt2.layers[1].attn.wqkv.bias, h.attn.c_attn.bias)
    assert torch.equal(gpt2.pos_embed.weight, hf.transformer.wpe.weight)
    for model in (llama, gpt2):
        assert all(p.device.type == "cpu" for p in model.parameters())  # nothing left on meta
        assert not any(p.requires_grad for p in model.parameters())


def test_sharded_safetensors_load_identical_weights(tiny_dirs, tmp_path):
    sharded = tmp_path / "sharded"
    _hf(tiny_dirs["qwen2"]).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    _same_weights(load_model(sharded), load_model(tiny_dirs["qwen2"]))


def test_only_indexed_shards_are_read(tiny_dirs, tmp_path):
    """A stray *.safetensors next to an index (an old consolidated file) is not mixed in."""
    sharded = tmp_path / "sharded"
    _hf(tiny_dirs["llama"]).save_pretrained(sharded, max_shard_size="20KB")
    stray = load_model(tiny_dirs["qwen3"])  # other shapes: would break the load if read
    from safetensors.torch import save_file

    save_file(
        {"model.embed_tokens.weight": stray.embed.weight.contiguous()}, sharded / "zz.safetensors"
    )
    _same_weights(load_model(sharded), load_model(tiny_dirs["llama"]))


def test_unsupported_model_type_names_the_supported_families(tiny_dirs, tmp_path):
    d = _copy_config_and_tokenizer(tiny_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(d)
    msg = str(err.value)
    assert "falcon" in msg
    native = {"gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"}
    native |= {"gemma2", "gemma3_text", "phi3"}
    for family in native:
        assert family in msg
    assert set(SUPPORTED_FAMILIES) == native


def test_pickle_only_checkpoint_needs_allow_pickle(tiny_dirs, tmp_path):
    d = _copy_config_and_tokenizer(tiny_dirs["llama"], tmp_path / "m")
    torch.save(_hf(tiny_dirs["llama"]).state_dict(), d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="allow-pickle"):
        load_model(d)
    with pytest.raises(ModelLoadError, match="allow-pickle"):
        LLM(d, dtype="float32", device="cpu", compile=False)
    _same_weights(load_model(d, allow_pickle=True), load_model(tiny_dirs["llama"]))


def test_missing_directory_and_missing_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_directory_without_weights(tiny_dirs, tmp_path):
    d = _copy_config_and_tokenizer(tiny_dirs["llama"], tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(d)


def test_checkpoint_missing_a_tensor_is_refused(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_config_and_tokenizer(tiny_dirs["llama"], tmp_path / "m")
    sd = load_file(tiny_dirs["llama"] / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    del sd["model.layers.0.post_attention_layernorm.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(d)


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama31") / "m"
    return save_tiny_model("llama", path, rope_parameters=LLAMA3_ROPE)


def test_llama31_rope_scaling_matches_transformers_greedy(llama31_dir, tmp_path):
    model = load_model(llama31_dir)
    assert model.cfg.rope_scaling == RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    assert _greedy(llama31_dir) == hf_greedy(llama31_dir, _prompts(), 10)
    # and the scaling is not a no-op here: logits differ from the unscaled model's
    plain_dir = tmp_path / "plain"
    shutil.copytree(llama31_dir, plain_dir)
    cfg = json.loads((plain_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain_dir / "config.json").write_text(json.dumps(cfg))
    plain = load_model(plain_dir)
    assert plain.cfg.rope_scaling == RopeScaling()
    outs = [last_logits(m, [_prompts()[1]]) for m in (model, plain)]
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)


def test_llama31_config_json_as_published():
    """Llama 3.1's config.json (transformers 4.x keys): rope_theta + rope_scaling."""
    hf = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
    }
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (8, 128, False)
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        config_from_hf(hf)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied, tiny_dirs, tmp_path):
    path = (
        save_tiny_model("llama", tmp_path / "m", tie_word_embeddings=tied)
        if tied
        else tiny_dirs["llama"]
    )
    model, hf = load_model(path), _hf(path)
    assert model.cfg.tie_embeddings is tied
    shares = model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert shares is tied
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.embed.weight, hf.model.embed_tokens.weight)
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.embed.weight)
    assert _greedy(path) == hf_greedy(path, _prompts(), 10)


@pytest.mark.parametrize("differs", [True, False])
def test_a_tied_config_with_its_own_head_in_the_checkpoint(differs, tmp_path):
    """config.json says tied but the checkpoint saves lm_head.weight: transformers uses that
    head when it differs from the embedding (and ties when it is the same), so batchgen does."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model("llama", tmp_path / "m", tie_word_embeddings=True)
    (f,) = path.glob("*.safetensors")
    sd = load_file(f)
    assert "lm_head.weight" not in sd
    embed = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = torch.randn_like(embed) if differs else embed.clone()
    save_file(sd, f, metadata={"format": "pt"})
    model = load_model(path)
    assert model.cfg.tie_embeddings is not differs
    assert (model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()) is not differs
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    assert _greedy(path) == hf_greedy(path, _prompts(), 10)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_half_precision_load_dtype_honoured(dtype, family, tiny_dirs):
    torch_dtype = getattr(torch, dtype)
    model = load_model(tiny_dirs[family], torch_dtype)
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    ref = load_model(tiny_dirs[family], torch.float32)
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(p, q.to(torch_dtype)), name  # cast once, straight from the file

    llm = LLM(tiny_dirs[family], dtype=dtype, device="cpu", compile=False, engine=ENGINE)
    assert llm.model.embed.weight.dtype == torch_dtype
    outs = llm.generate(_prompts(), SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert {kv.k.dtype for kv in llm.model.kv_caches} == {torch_dtype}  # allocated at the first run
    assert all(len(o.token_ids) == 10 for o in outs)
    assert all(0 <= t < model.cfg.vocab_size for o in outs for t in o.token_ids)
    assert all(torch.isfinite(torch.tensor(o.logprobs)).all() for o in outs)


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_lm_head_is_column_major_unless_tied(tmp_path, tied):
    """On the CPU in float32 an untied LM head is stored column-major (transformer.LMHead's
    faster mm) with the same logits as nn.Linear's; a tied one stays the embedding's rows."""
    d = save_tiny_model("llama", tmp_path / "m", tie_word_embeddings=tied)
    model = load_model(d, torch.float32, "cpu")
    w = model.lm_head.weight
    assert (w.stride(0) == 1) is not tied and (w is model.embed.weight) is tied
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(model.lm_head(x), torch.nn.functional.linear(x, w.contiguous()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d)
    torch.testing.assert_close(w, hf.lm_head.weight.detach())
    assert load_model(d, torch.bfloat16, "cpu").lm_head.weight.is_contiguous()
