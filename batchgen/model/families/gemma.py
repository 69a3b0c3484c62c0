"""Gemma 2 and Gemma 3 text models on transformer.py's decoder.

What differs from Llama (transformers' modeling_gemma2.py / modeling_gemma3.py, 5.25):
- RMSNorm scales by (1 + w), computed in float32 before the cast back (Llama casts first);
- four norms a layer: the attention's and the MLP's outputs are normalised too, before their
  residual adds (model/checkpoint/names.py maps the names);
- the embedding is scaled by sqrt(hidden_size), that factor rounded to the model's dtype;
- attention has its own softmax scale, query_pre_attn_scalar ** -0.5, and each layer its window
  (`layer_types`: sliding layers see `sliding_window` tokens, full layers all); Gemma 2 caps the
  attention logits (cap * tanh(s / cap)) and the final logits; Gemma 3 normalises q and k per
  head ((1 + w) again) and rotates its sliding layers with a RoPE of their own base.

The scale and soft-cap reach batchgen's step attention as `AttnParams` (the transformers backend
passes the same, model/hf/backend.py), so prefill and decode, eager and compiled, run the same
attention code as every family; CUDA's flex decode op takes them too (attention/paged_flex.py:
the scale into q, the soft-cap as a score_mod), so no path is refused or rebuilt as gather. The
step's masks are built once per window value (two at most) and shared by the layers of that
window (Transformer.bind, before the forward, compiled or not).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from batchgen.model.attention.sdpa import AttnParams
from batchgen.model.config import GEMMA_FAMILIES, ModelConfig, RopeScaling
from batchgen.model.families.rope import rope_tables
from batchgen.model.families.transformer import MLP, Attention, Transformer


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (x * (1 + w)) in float32, then cast: transformers' Gemma order (Llama's casts first)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """Attention with the layer's scale and soft-cap; Gemma 3's q/k norms are (1 + w) ones."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.params = AttnParams(cfg.attn_scale, cfg.attn_softcap)


class GemmaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = GemmaAttention(cfg)
        self.post_attn_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.post_mlp_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


@functools.cache
def embed_scale(dim: int, dtype: torch.dtype) -> float:
    """sqrt(dim) rounded to dtype, as transformers' scaled embedding multiplies by it."""
    return torch.tensor(dim**0.5, device="cpu").to(dtype).item()


class GemmaTransformer(Transformer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(GemmaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.windows = cfg.layer_windows or (cfg.sliding_window,) * cfg.n_layers
        self.embed_mult = embed_scale(cfg.dim, torch.float32)  # setup_caches: the dtype's
        self.register_buffer("local_cos", None, persistent=False)  # Gemma 3's sliding layers'
        self.register_buffer("local_sin", None, persistent=False)

    def setup_caches(self, num_blocks: int, block_size: int) -> None:
        super().setup_caches(num_blocks, block_size)
        cfg = self.cfg
        self.embed_mult = embed_scale(cfg.dim, self.embed.weight.dtype)
        if cfg.local_rope_theta is not None:
            self.local_cos, self.local_sin = rope_tables(
                cfg.max_position_embeddings,
                cfg.head_dim,
                cfg.local_rope_theta,
                RopeScaling(),
                self.embed.weight.device,
            )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.windows

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As Transformer.hidden: (T,) packed tokens and positions -> (T, dim), with the
        scaled embedding and Gemma 3's local RoPE table on its sliding layers."""
        full = (self.rope_cos[positions], self.rope_sin[positions])  # (T, D) each
        local = full
        if self.local_cos is not None:
            local = (self.local_cos[positions], self.local_sin[positions])
        x = self.embed(tokens) * self.embed_mult  # (T, dim)
        for block, window in zip(self.layers, self.windows, strict=True):
            x = block(x, full if window is None else local)
        return x

    def logits(self, x: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x.index_select(0, logits_index)))  # (S, vocab)
        cap = self.cfg.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def decoder_class(cfg: ModelConfig) -> type[Transformer]:
    """The module a native family is built as."""
    return GemmaTransformer if cfg.family in GEMMA_FAMILIES else Transformer
