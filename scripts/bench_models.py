"""Random-weight checkpoints in the shapes the benchmarks use, built once and reused.

Speed depends on shapes, not on what the weights say, so the benchmarks use random
weights in real model shapes and never touch the hub. A checkpoint is a normal
transformers directory (config.json, safetensors, generation_config.json and a
word-level tokenizer whose vocabulary matches the model's), which batchgen's loader and
`AutoModelForCausalLM.from_pretrained` both read.

    python scripts/bench_models.py llama-1b --dtype bfloat16 --device cuda   # prints the dir
    python scripts/bench_models.py --list

The model is built on the meta device, materialised on `device` (a GPU fills an 8B model
in a second; the host would take minutes) and saved with `save_pretrained`, so tied
weights and shard names are transformers' own.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

BOS, EOS = 0, 1  # special ids; benchmark prompts draw their tokens from [2, vocab)


@dataclass(frozen=True)
class Shape:
    family: str  # transformers model_type: "gpt2", "llama" or "qwen3_moe"
    config: dict = field(default_factory=dict)  # transformers config kwargs
    note: str = ""


SHAPES: dict[str, Shape] = {
    # tests and smoke runs
    "tiny-llama": Shape(
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=2048,
        ),
        "2 layers, 0.1M parameters: smoke tests only",
    ),
    # CPU
    "llama-30m": Shape(
        "llama",
        dict(
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            vocab_size=32000,
            max_position_embeddings=2048,
        ),
        "Llama-shaped, 34M parameters (25M of them embeddings and head), GQA 6/2",
    ),
    "llama-55m": Shape(
        "llama",
        dict(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=32000,
            max_position_embeddings=2048,
        ),
        "Llama-shaped, 57M parameters (33M of them embeddings and head), GQA 8/2: the "
        "engine issue's CPU benchmark shape",
    ),
    "qwen3-moe-60m": Shape(
        "qwen3_moe",
        dict(
            hidden_size=384,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=32000,
            max_position_embeddings=2048,
        ),
        "Qwen3-MoE-shaped, 55M parameters (28M in 16 experts a layer, 4 of them a token; 25M "
        "embeddings and head): the native MoE against the transformers backend",
    ),
    "phi4-mini-40m": Shape(
        "phi3",
        dict(
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            partial_rotary_factor=0.75,  # 48 of 64 features rotate
            original_max_position_embeddings=1024,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0 + 0.05 * i for i in range(24)],
                long_factor=[1.0 + 0.5 * i for i in range(24)],
            ),
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        "Phi-4-mini-shaped, 34M parameters (25M embeddings and head): fused qkv_proj and "
        "gate_up_proj, partial rotary 0.75, longrope (rows under 1024 tokens: the short "
        "factors): native Phi-3 against the transformers backend",
    ),
    "gemma3-30m": Shape(
        "gemma3_text",
        dict(
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=64,
            vocab_size=32000,
            max_position_embeddings=2048,
        ),
        "Gemma-3-shaped, 22M parameters (12M of them the tied embedding), 5 sliding layers "
        "(64-token window, local RoPE) to 1 global: native Gemma against the backend",
    ),
    "gpt2-124m": Shape(
        "gpt2",
        dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=2048),
        "GPT-2 small (124M) with 2048 positions instead of 1024, so a 1024-token prompt "
        "plus 256 new tokens fits",
    ),
    # GPU
    "llama-1b": Shape(
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        "Llama-3.2-1B shape (1.24B, tied embeddings, Llama 3 RoPE scaling)",
    ),
    "qwen-0.5b": Shape(
        "llama",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        "Qwen2.5-0.5B's shape as a Llama (0.49B, tied embeddings, GQA 14/2; no qkv bias)",
    ),
    "llama-8b": Shape(
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
        "Llama-3-8B shape (8.03B)",
    ),
}

DEFAULT_CACHE = Path(os.environ.get("BATCHGEN_BENCH_CACHE", Path.home() / ".cache/batchgen-bench"))


def hf_config(name: str):
    import transformers

    shape = SHAPES[name]
    kw = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, **shape.config)
    if shape.family == "gpt2":
        return transformers.GPT2Config(**kw)
    rope = kw.pop("rope_parameters", None)
    if rope is not None:
        if int(transformers.__version__.split(".")[0]) >= 5:
            kw["rope_parameters"] = rope
        else:  # 4.x: rope_theta + rope_scaling
            kw["rope_theta"] = rope["rope_theta"]
            if rope["rope_type"] != "default":
                kw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if shape.family != "llama":
        return transformers.AutoConfig.for_model(shape.family, **kw)
    return transformers.LlamaConfig(**kw)


def word_tokenizer(vocab_size: int):
    """A tokenizer with exactly vocab_size entries ("<bos>", "<eos>", "t2", ...): enough to
    decode any generated id into text, which both engines do for their outputs."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<bos>": BOS, "<eos>": EOS, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>"
    )


def num_params(name: str) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(name))
    return sum(p.numel() for p in model.parameters())


def build(
    name: str, path: str | Path, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> Path:
    """Write a random `name`-shaped checkpoint in dtype to path and return path."""
    import torch
    import transformers

    path = Path(path)
    torch_dtype = getattr(torch, dtype)
    cfg = hf_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    model.to_empty(device=device)
    # to_empty gives a tied head its own tensor: tied again, or it is saved apart (random) and
    # transformers 5 then runs the checkpoint untied where batchgen's loader ties it
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # tied weights appear once
            if pname.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # norm scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(path)
    word_tokenizer(cfg.vocab_size).save_pretrained(path)
    (path / "bench_shape.json").write_text(
        json.dumps({"shape": name, "dtype": dtype, "seed": seed, "config": SHAPES[name].config})
    )
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def cached(
    name: str, dtype: str = "float32", device: str = "cpu", root: str | Path | None = None
) -> Path:
    """The checkpoint dir for (name, dtype) under root, built on first use."""
    root = Path(root) if root is not None else DEFAULT_CACHE
    path = root / f"{name}-{dtype}"
    marker = path / "bench_shape.json"
    if marker.is_file():
        meta = json.loads(marker.read_text())
        if meta.get("shape") == name and meta.get("config") == SHAPES[name].config:
            return path
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    build(name, tmp, dtype, device)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="where to materialise the random weights")
    p.add_argument("--root", default=None, help=f"cache root (default {DEFAULT_CACHE})")
    p.add_argument("--list", action="store_true", help="list the shapes and their sizes")
    args = p.parse_args()
    if args.list or args.shape is None:
        for name, s in SHAPES.items():
            print(f"{name:12s} {num_params(name) / 1e6:9.1f}M  {s.note}")
        return
    print(cached(args.shape, args.dtype, args.device, args.root))


if __name__ == "__main__":
    main()
