"""A compact decoder covering GPT-2, Llama, Mistral, Qwen2 and Qwen3.

Every row of a batch carries its own positions: `input_pos` (B, T) feeds RoPE or the
learned position table, `slots` (B, T) says where the step's keys/values go in the
static cache, and `kv_start` (B,) is the first cache slot that belongs to the row
(left padding sits before it). Attention runs over the first `kv_len` slots, a Python
int from a bounded set, so each (batch, kv_len) pair is one static graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.model.config import ModelConfig, NormKind, PositionKind
from batchgen.model.kv_cache import KVCache
from batchgen.model.rope import apply_rope, rope_tables


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


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":  # GPT-2's gelu_new, written out as transformers does
        return (
            0.5
            * x
            * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        )
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"unknown activation {name!r}")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, cfg.qkv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
        cache_index: torch.Tensor,
        row_stride: int,
        kv_len: int,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv_heads, self.head_dim)
        v = v.view(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_all, v_all = self.kv_cache.update(
            cache_index, k, v, row_stride, kv_len, rows
        )  # (B, S, Hkv, D)
        # Grouped-query attention as plain attention: each kv head's group of g query heads
        # is folded into the query length, (B, Hkv, g*T, D). SDPA then needs no copies of
        # K/V per query head, and no GQA path (which, with a mask, takes the math kernel).
        g, hkv, d = self.n_heads // self.n_kv_heads, self.n_kv_heads, self.head_dim
        q = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
        y = F.scaled_dot_product_attention(
            q,
            k_all.transpose(1, 2),  # (B, Hkv, S, D)
            v_all.transpose(1, 2),
            attn_mask=mask,  # (B, 1, g*T, S), True = attend
        )
        y = y.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4)  # (B, T, Hkv, g, D)
        return self.wo(y.reshape(b, t, q_size))


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


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, mask, cache_index, row_stride, kv_len, rows) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask, cache_index, row_stride, kv_len, rows)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = (
            nn.Embedding(cfg.max_position_embeddings, cfg.dim)
            if cfg.position == PositionKind.LEARNED
            else None
        )
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", None, persistent=False)  # (P, head_dim), float32
        self.register_buffer("rope_sin", None, persistent=False)

    def setup_caches(self, capacity_tokens: int, max_seq: int) -> None:
        """Allocate the static KV cache (and RoPE tables) on the model's device and dtype:
        room for capacity_tokens tokens in all, rows of up to max_seq."""
        w = self.embed.weight
        for block in self.layers:
            block.attn.kv_cache = KVCache(
                capacity_tokens, self.cfg.n_kv_heads, self.cfg.head_dim, w.dtype, w.device
            )
        if self.cfg.position == PositionKind.ROPE:
            n_pos = max(max_seq, self.cfg.max_position_embeddings)
            cos, sin = rope_tables(
                n_pos, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling, w.device
            )
            self.rope_cos, self.rope_sin = cos, sin

    @property
    def kv_caches(self) -> list[KVCache]:
        return [block.attn.kv_cache for block in self.layers]

    def attention_mask(
        self, slots: torch.Tensor, kv_start: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """(B, 1, g*T, kv_len) boolean: a query at slot q sees slots [kv_start, q] of its
        row; repeated for the g query heads that share a kv head (see Attention)."""
        k_slots = torch.arange(kv_len, device=slots.device)  # (S,)
        q = slots[:, :, None]  # (B, T, 1)
        visible = (k_slots >= kv_start[:, None, None]) & (k_slots <= q)
        if self.cfg.sliding_window is not None:
            visible &= (q - k_slots) < self.cfg.sliding_window
        # Padding queries (slot < kv_start) see only themselves, so no softmax row is empty.
        visible |= k_slots == q
        b, t, s = visible.shape
        g = self.cfg.n_heads // self.cfg.n_kv_heads
        return visible[:, None, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        slots: torch.Tensor,
        kv_start: torch.Tensor,
        kv_len: int,
        row_stride: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, input_pos, slots: (B, T); kv_start: (B,). Row b owns cache slots
        [r * row_stride, (r + 1) * row_stride) with r = rows[b] (default r = b: rows is
        for prefilling some rows of a running batch). Returns the logits of each row's
        last token, (B, vocab), in float32."""
        b, t = tokens.shape
        x = self.embed(tokens)  # (B, T, dim)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(input_pos)
        else:
            rope = (self.rope_cos[input_pos], self.rope_sin[input_pos])  # (B, T, D) each
        mask = self.attention_mask(slots, kv_start, kv_len)
        row = torch.arange(b, device=tokens.device) if rows is None else rows  # (B,)
        cache_index = row[:, None] * row_stride + slots  # (B, T)
        for block in self.layers:
            x = block(x, rope, mask, cache_index, row_stride, kv_len, rows)
        x = self.norm(x[:, -1])  # (B, dim): left padding puts every row's last token at T-1
        return self.lm_head(x).float()
