"""A compact decoder covering GPT-2, Llama, Mistral, Qwen2, Qwen3 and the MoE families
(Qwen3-MoE, Mixtral: model/families/moe.py).

A forward is one engine step: a flat, packed run of tokens from many sequences, each with
its own position. Keys/values go to the paged cache and attention reads each sequence's
own blocks (model/attention/step.py); only the tokens whose next token is sampled reach the
final norm and the LM head.

The forward is three parts: `bind` (the step's attention masks, built once and read by every
layer's attention op, model/attention/op.py), `hidden` (tokens and positions -> the last
layer's hidden states: the part `--compile` compiles, one graph over a symbolic token count,
engine/compiled_forward.py) and `logits` (the sampled rows through the final norm and the LM
head, eager: one large matmul, outside the token-count graphs since its rows vary apart).
Eager and compiled runs go through the same code (eager, the attention op's body is called
without the dispatcher: op.attention_eager).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.op import (
    BoundStep,
    LayerAttention,
    attention_eager,
    bound,
)
from batchgen.model.attention.sdpa import DEFAULT
from batchgen.model.attention.step import StepAttention
from batchgen.model.config import ModelConfig, NormKind, PositionKind
from batchgen.model.families.activations import activation
from batchgen.model.families.moe import MoE
from batchgen.model.families.rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as transformers does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == NormKind.RMS:
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, cfg.qkv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.kv_cache: PagedKVCache | None = None
        self.layer_idx = 0  # its number in the model: how the attention op finds its cache
        self.params = DEFAULT  # softmax scale and soft-cap: torch's defaults (Gemma's: gemma.py)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv_heads, self.head_dim)
        v = v.view(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if torch.compiler.is_compiling():  # (T, H, D), the bound step's
            y = torch.ops.batchgen.attention(q, k, v, self.layer_idx)
        else:
            y = attention_eager(q, k, v, self.layer_idx)
        return self.wo(y.reshape(t, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated, self.act = cfg.gated_mlp, cfg.activation
        n_in = 2 * cfg.intermediate_size if cfg.gated_mlp else cfg.intermediate_size
        self.w_in = nn.Linear(cfg.dim, n_in, bias=cfg.mlp_bias)  # gated: [gate; up] fused
        self.w_out = nn.Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.w_out(activation(self.act, gate) * up)
        return self.w_out(activation(self.act, h))


# The decoder blocks' linear layers, by their names in a Block: what quantization and the CPU's
# weight packing replace.
LINEAR_LAYERS = ("attn.wqkv", "attn.wo", "mlp.w_in", "mlp.w_out")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.dim)
        self.mlp = MoE(cfg) if cfg.moe_layer(i) else MLP(cfg)

    def forward(self, x, rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding with uninitialised weights (the checkpoint's replace them). Its default
    init is normal_, whose first call on the meta device costs seconds of lazy setup."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class LMHead(nn.Linear):
    """The LM head. Its weight may be stored column-major, a (vocab, dim) view of a contiguous
    (dim, vocab) tensor (model/checkpoint/loader.py does so on the CPU); then x @ W^T is a plain mm
    over contiguous memory, which oneDNN ran 1.2-1.3x faster than nn.Linear over the row-major
    weight at 16-160 rows, and a whole mixed job ~8% faster with the same tokens
    (docs/benchmarks.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.stride(0) == 1 and x.dim() == 2:
            return torch.mm(x, self.weight.t())  # (S, dim) @ (dim, vocab), contiguous
        return F.linear(x, self.weight)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = (
            _embedding(cfg.max_position_embeddings, cfg.dim)
            if cfg.position == PositionKind.LEARNED
            else None
        )
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.dim)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", None, persistent=False)  # (P, head_dim), float32
        self.register_buffer("rope_sin", None, persistent=False)

    def setup_caches(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged KV cache (and RoPE tables) on the model's device and dtype:
        num_blocks blocks of block_size tokens per layer."""
        w = self.embed.weight
        for i, block in enumerate(self.layers):
            block.attn.layer_idx = i
            block.attn.kv_cache = PagedKVCache(
                num_blocks, block_size, self.cfg.n_kv_heads, self.cfg.head_dim, w.dtype, w.device
            )
        if self.cfg.position == PositionKind.ROPE:
            cos, sin = rope_tables(
                self.cfg.max_position_embeddings,
                self.cfg.rotary_dim,
                self.cfg.rope_theta,
                self.cfg.rope_scaling,
                w.device,
            )
            self.rope_cos, self.rope_sin = cos, sin

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return (self.cfg.sliding_window,) * self.cfg.n_layers

    @property
    def kv_caches(self) -> list[PagedKVCache]:
        return [block.attn.kv_cache for block in self.layers]

    def bind(self, step: StepAttention) -> BoundStep:
        """step with its attention masks built (once per window value, shared by the layers
        of that window) and each layer's cache, parameters and window: what the attention op
        reads during one forward."""
        cfg = self.cfg
        queries = cfg.n_heads // cfg.n_kv_heads  # this rank's query heads per kv head
        cache, n = self.kv_caches[0], cfg.max_position_embeddings
        windows = self.layer_windows
        steps = {w: step.with_masks(w, cache, queries, n) for w in set(windows)}
        layers = tuple(
            LayerAttention(b.attn.kv_cache, b.attn.params, w)
            for b, w in zip(self.layers, windows, strict=True)
        )
        return BoundStep(steps, layers)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """tokens, positions (T,): a step's tokens, packed; step: where their keys/values go
        and what each attends to. Returns the float32 logits (S, vocab) of the tokens at
        logits_index (S,): those whose next token is sampled."""
        with bound(self.bind(step)):
            return self.logits(self.hidden(tokens, positions), logits_index)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) tokens at (T,) positions -> the last layer's (T, dim) hidden states, the
        attention of each layer that of the bound step (`bind`, attention.op.bound)."""
        x = self.embed(tokens)  # (T, dim)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = (self.rope_cos[positions], self.rope_sin[positions])  # (T, D) each
        for block in self.layers:
            x = block(x, rope)
        return x

    def logits(self, x: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        """hidden states (T, dim) -> float32 logits (S, vocab) of the rows at logits_index."""
        return self.lm_head(self.norm(x.index_select(0, logits_index))).float()
