"""Tensor parallelism without processes: which slices each rank loads, the sizes refused,
the per-rank arithmetic. (The ranks running together are in test_tensor_parallel_ranks.py.)"""

import dataclasses

import pytest
import torch

from batchgen.model.checkpoint.loader import load_model
from batchgen.model.checkpoint.lora import merge_lora
from batchgen.model.families.hf_config import config_from_hf, read_hf_config
from batchgen.model.parallel.sharding import (
    TPShard,
    check_sizes,
    local_config,
    valid_sizes,
    weight_bytes,
)


def _whole_from_shards(full, shards):
    """Reassemble the TP=1 parameters from the ranks' parameters, per the sharding rules."""
    cfg = full.cfg
    d = cfg.head_dim
    out = {}
    for name in full.state_dict():
        parts = [s.state_dict()[name] for s in shards]
        if name.endswith("attn.wqkv.weight") or name.endswith("attn.wqkv.bias"):
            loc = shards[0].cfg
            ql, kvl = loc.n_heads * d, loc.n_kv_heads * d
            q = torch.cat([p[:ql] for p in parts])
            k = torch.cat([p[ql : ql + kvl] for p in parts])
            v = torch.cat([p[ql + kvl :] for p in parts])
            if loc.n_kv_heads * len(shards) > cfg.n_kv_heads:  # replicated KV heads
                k, v = k[: cfg.n_kv_heads * d], v[: cfg.n_kv_heads * d]
            out[name] = torch.cat([q, k, v])
        elif name.endswith("mlp.w_in.weight") or name.endswith("mlp.w_in.bias"):
            if cfg.gated_mlp:
                half = parts[0].shape[0] // 2
                gate = torch.cat([p[:half] for p in parts])
                up = torch.cat([p[half:] for p in parts])
                out[name] = torch.cat([gate, up])
            else:
                out[name] = torch.cat(parts)
        elif name.endswith(("attn.wo.weight", "mlp.w_out.weight")):
            out[name] = torch.cat(parts, dim=1)
        elif name.endswith(("attn.wo.bias", "mlp.w_out.bias")):
            assert all(not p.any() for p in parts[1:]), "the bias is added once, by rank 0"
            out[name] = parts[0]
        elif name in ("embed.weight", "lm_head.weight"):
            out[name] = torch.cat(parts)
        else:  # norms, position table: replicated
            assert all(torch.equal(p, parts[0]) for p in parts)
            out[name] = parts[0]
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "llama-kv1"])
def test_each_rank_loads_its_slices_and_they_make_the_whole(tiny_dirs, one_kv_head, family):
    path = one_kv_head if family == "llama-kv1" else tiny_dirs[family]
    full = load_model(path)
    shards = [load_model(path, tp=TPShard(r, 2)) for r in range(2)]
    for name, w in _whole_from_shards(full, shards).items():
        assert torch.equal(w, full.state_dict()[name]), name
    local = shards[0].cfg
    assert local.n_heads == full.cfg.n_heads // 2
    assert local.vocab_size == full.cfg.vocab_size // 2
    assert local.n_kv_heads == max(1, full.cfg.n_kv_heads // 2)
    if full.cfg.tie_embeddings:
        assert all(s.lm_head.weight is s.embed.weight for s in shards)


def test_one_kv_head_is_replicated_on_both_ranks(one_kv_head):
    full = load_model(one_kv_head)
    d, q = full.cfg.head_dim, full.cfg.n_heads * full.cfg.head_dim
    kv = full.layers[0].attn.wqkv.weight[q:]  # the one head's k and v
    for r in range(2):
        shard = load_model(one_kv_head, tp=TPShard(r, 2))
        assert shard.cfg.n_kv_heads == 1
        assert torch.equal(shard.layers[0].attn.wqkv.weight[q // 2 :], kv)
        assert shard.layers[0].attn.wqkv.weight.shape[0] == q // 2 + 2 * d


def test_a_rank_holds_about_half_the_weights(tiny_dirs):
    full = load_model(tiny_dirs["llama"])
    shard = load_model(tiny_dirs["llama"], tp=TPShard(1, 2))

    def nbytes(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())

    assert nbytes(shard) <= 0.6 * nbytes(full)
    cfg = full.cfg
    assert weight_bytes(cfg, 4, 2) <= 0.6 * weight_bytes(cfg, 4, 1)
    assert abs(weight_bytes(cfg, 4, 2) - nbytes(shard)) <= 0.1 * nbytes(shard)  # norms aside


def test_sizes_that_do_not_divide_are_refused_naming_those_that_do(tiny_dirs):
    cfg = config_from_hf(read_hf_config(tiny_dirs["llama"]))  # 4 heads, 2 KV heads, vocab 512
    check_sizes(cfg, 2)
    check_sizes(cfg, 4)  # 4 ranks, 2 KV heads: each KV head on 2 ranks
    with pytest.raises(ValueError, match=r"attention heads 4.*sizes that work: 1, 2, 4$"):
        check_sizes(cfg, 3)
    assert valid_sizes(cfg) == [1, 2, 4]
    odd = dataclasses.replace(cfg, n_heads=8, n_kv_heads=8, intermediate_size=66)
    with pytest.raises(ValueError, match="does not divide the model's intermediate size 66;"):
        local_config(odd, TPShard(0, 4))
    assert local_config(odd, TPShard(1, 2)).intermediate_size == 33


def test_lora_merges_each_ranks_slice(tiny_dirs, tmp_path):
    """The merged shards make the merged whole: B's rows for column-parallel layers, A's
    columns for row-parallel ones."""
    import peft
    import transformers

    base = tiny_dirs["llama"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    lora = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    lora.save_pretrained(tmp_path / "adapter")
    cfg = config_from_hf(read_hf_config(base))
    full = load_model(base)
    merge_lora(full, tmp_path / "adapter")
    shards = [load_model(base, tp=TPShard(r, 2)) for r in range(2)]
    for r, s in enumerate(shards):
        merge_lora(s, tmp_path / "adapter", cfg=cfg, tp=TPShard(r, 2))
    for name, w in _whole_from_shards(full, shards).items():
        torch.testing.assert_close(w, full.state_dict()[name], rtol=1e-6, atol=1e-6, msg=name)
