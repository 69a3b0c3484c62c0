"""Tiny random checkpoints of every supported family, saved with transformers.

Used by the tests and benchmarks: `save_tiny_model("llama", dir)` writes a real
checkpoint directory (config.json, model.safetensors, generation_config.json and a
small byte-level BPE tokenizer) that batchgen loads through its normal loader.

    python tests/tiny_models.py llama /tmp/tiny-llama [--sharpen 6]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
VOCAB = 512
# How much `sharpen` scales the queries and keys: their logits grow by its square. A random
# init's attention is near-uniform, so a model missing a feature of its attention (a softmax
# scale, a window, RoPE) often still picks the same greedy tokens; at 6x such removals change
# them (tests/test_exactness_controls.py).
SHARPEN = 6.0
EOS = "<|endoftext|>"

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. batch inference sorts prompts by length "
    "and packs them into buckets. a static cache keeps every shape fixed so the compiler "
    "sees one graph. label the sentiment of this review: great product, would buy again. "
    "summarise the text in one sentence. 0123456789 !?,;:'\"()[]{}<>+-*/=_ "
)


TOKENS = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def llama_sizes(hidden: int, layers: int = 2) -> dict:
    """A tiny Llama-shaped config's sizes (4 heads, 2 KV heads, 256 positions) and tokens."""
    return dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **TOKENS,
    )


def _config(family: str, **overrides) -> transformers.PretrainedConfig:
    if family == "gpt2":
        kw = dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, **TOKENS)
        return transformers.GPT2Config(**{**kw, **overrides})
    kw = llama_sizes(32)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    if family == "qwen3":
        kw["head_dim"] = 16  # Qwen3 sets head_dim independently of hidden/heads
    if family == "mistral":
        kw["sliding_window"] = 64
    return cls(**{**kw, **overrides})


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|bos|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token=EOS, pad_token=EOS
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return fast


@torch.no_grad()
def sharpen_attention(model: transformers.PreTrainedModel, factor: float = SHARPEN) -> None:
    """Scale every layer's queries and keys by factor, so attention is peaked. With qk-norm
    (Qwen3) the norms' weights are scaled, as they set the size of q and k (the projections'
    factor is normalised away); GPT-2's fused c_attn (Conv1D, weight (dim, 3 * dim), laid
    out [q | k | v]) has its q and k thirds scaled."""
    for name, p in model.named_parameters():
        if ".c_attn." in name:
            p[..., : 2 * p.shape[-1] // 3] *= factor
        elif any(f".{m}." in name for m in ("q_proj", "k_proj", "q_norm", "k_norm")):
            p *= factor


# GPT-2 ties its head to the token embedding, which at the default init (std 0.02) outweighs
# the blocks' outputs: the model repeats its last token (1-3 distinct tokens in 12), however
# sharp its attention. At 0.2 the blocks decide the next token.
_SHARP_OVERRIDES = {"gpt2": dict(initializer_range=0.2)}


def save_tiny_model(
    family: str,
    path: str | Path,
    seed: int = 0,
    with_tokenizer: bool = True,
    sharpen: float | None = None,
    **overrides,
) -> Path:
    """Write a random tiny `family` checkpoint to path and return it. sharpen: a factor for
    `sharpen_attention` (None: attention as initialised, near-uniform), for a model whose
    greedy tokens change when a feature is missing."""
    path = Path(path)
    torch.manual_seed(seed)
    if sharpen is not None:
        overrides = {**_SHARP_OVERRIDES.get(family, {}), **overrides}
    cfg = _config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if sharpen is not None:
        sharpen_attention(model, sharpen)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("out")
    p.add_argument("--sharpen", type=float, help="scale queries and keys by this factor")
    args = p.parse_args()
    print(save_tiny_model(args.family, args.out, sharpen=args.sharpen))


if __name__ == "__main__":
    main()
