"""Architecture description of a decoder, independent of any file format.

`ModelConfig` says *what* to build; `batchgen.model.families.hf_config` knows how Hugging Face
`config.json` files map onto it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from batchgen.choices import ModelImpl


class Family(str, enum.Enum):
    GPT2 = "gpt2"
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"
    PHI3 = "phi3"
    GEMMA2 = "gemma2"
    GEMMA3_TEXT = "gemma3_text"


# Gemma's decoder (model/families/gemma.py): (1 + w) norms, four a layer, a scaled embedding
GEMMA_FAMILIES = frozenset({Family.GEMMA2, Family.GEMMA3_TEXT})


class NormKind(str, enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class PositionKind(str, enum.Enum):
    ROPE = "rope"  # rotary, computed from per-row positions
    LEARNED = "learned"  # GPT-2's absolute position table


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind is "default", "linear", "llama3" or "longrope"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3, model/families/longrope.py): each frequency's divisor for rows within the
    # original context and for rows beyond it (rotary_dim / 2 each), and the scale of cos and sin
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    SUPPORTED = ("default", "linear", "llama3", "longrope")

    def __post_init__(self) -> None:
        if self.kind not in self.SUPPORTED:
            raise ValueError(
                f"rope scaling {self.kind!r} is not supported; supported: "
                f"{', '.join(self.SUPPORTED)}"
            )


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """A native family's architecture; or, for a model the transformers backend runs
    (impl TRANSFORMERS, family None), the sizes the engine and stats read."""

    family: Family | None
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm: NormKind = NormKind.RMS
    norm_eps: float = 1e-6
    position: PositionKind = PositionKind.ROPE
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE on the first 0.75 of head_dim
    activation: str = "silu"  # "silu" | "gelu_tanh" | "gelu_pytorch_tanh" | "gelu"
    gated_mlp: bool = True  # SwiGLU-style gate * up (Llama) vs a plain 2-layer MLP (GPT-2)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_embeddings: bool = False
    sliding_window: int | None = None  # every layer's window; None if any layer sees all
    impl: ModelImpl = ModelImpl.NATIVE
    model_type: str = ""  # config.json's
    param_count: int | None = None  # counted from the built model (the backend's), not sized
    # (n_kv_heads, head_dim) of each layer's cache where layers differ (the backend's: Gemma 4's
    # global layers); () when every layer's is (n_kv_heads, head_dim)
    layer_kv: tuple[tuple[int, int], ...] = ()
    # Mixture of experts (Qwen3-MoE, Mixtral; model/families/moe.py): each token's MLP is the
    # weighted sum of experts_per_token of n_experts experts (moe_intermediate_size wide each),
    # picked by a router; norm_topk_prob: the picked weights renormalised to sum to 1. dense_layers:
    # the layers that keep a dense MLP of intermediate_size. n_experts 0: a dense model.
    n_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # Gemma 2/3 (model/families/gemma.py): the softmax scale (None: 1/sqrt(head_dim)), the soft-caps
    # of the attention logits and of the final logits (None: none), each layer's window where
    # layers differ (() : sliding_window for every layer), and the sliding layers' own RoPE
    # base (Gemma 3's local layers; no scaling), None: every layer's is rope_theta.
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None
    # a classifier head's, by logit (families/classifier_head.py)
    labels: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        sizes = (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        )
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("norm_eps", "rope_theta"):  # NaN or <= 0 runs, and writes garbage
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(
                f"experts per token ({self.experts_per_token}) must be 1 to the number of "
                f"experts ({self.n_experts})"
            )
        if self.n_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be positive ({self.n_experts} experts)")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} leaves {self.rotary_dim} of "
                f"head_dim {self.head_dim} rotated (must be a positive even number)"
            )
        scaling = self.rope_scaling
        if scaling.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ValueError(
                        f"longrope's {name} must have {self.rotary_dim // 2} values (half the "
                        f"rotary dimensions), not {len(getattr(scaling, name))}"
                    )

    @property
    def rotary_dim(self) -> int:
        """The leading features of each head that RoPE rotates (transformers' rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_rope(self) -> LongRopeRows | None:
        """A native longrope model's RoPE table rows (LongRopeRows); None for any other model,
        and for the transformers backend, which picks its factors itself."""
        scaling = self.rope_scaling
        if scaling.kind != "longrope" or self.impl != ModelImpl.NATIVE:
            return None
        return LongRopeRows(scaling.original_max_position_embeddings, self.max_position_embeddings)

    def moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts."""
        return self.n_experts > 0 and i not in self.dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layer(i) for i in range(self.n_layers))

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def layer_params(self, experts: int | None = None) -> int:
        """The decoder blocks' matrices (norms left out), a MoE layer's with `experts` of its
        experts (None: all of them, the weights held; experts_per_token: those a token
        runs through, its FLOPs)."""
        attn = self.dim * self.qkv_dim + self.n_heads * self.head_dim * self.dim
        mlp = (3 if self.gated_mlp else 2) * self.dim * self.intermediate_size
        n_moe = self.n_moe_layers
        if not n_moe:
            return self.n_layers * (attn + mlp)
        experts = self.n_experts if experts is None else experts
        moe = self.n_experts * self.dim + experts * 3 * self.dim * self.moe_intermediate_size
        return self.n_layers * attn + (self.n_layers - n_moe) * mlp + n_moe * moe

    @property
    def active_layer_params(self) -> int:
        """layer_params a token runs through: a MoE layer's router and picked experts."""
        return self.layer_params(self.experts_per_token or None)

    @property
    def num_params(self) -> int:
        """Every parameter held (a MoE model's every expert): what memory is sized by."""
        if self.param_count is not None:
            return self.param_count
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.layer_params() + embed

    @property
    def rope_table_bytes(self) -> int:
        """Peak bytes of building the float32 RoPE tables (families/rope.py rope_tables): the
        (P, D/2) frequencies, the (P, D) angles, and the cos and sin tables, P positions long."""
        if self.position != PositionKind.ROPE:
            return 0
        tables = 2 if self.local_rope_theta is not None else 1  # Gemma 3's local and global
        tables *= 2 if self.rope_scaling.kind == "longrope" else 1  # short and long factors'
        return int(self.max_position_embeddings * self.head_dim * 4 * 3.5) * tables

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token of one row occupies, across all layers."""
        if self.layer_kv:
            return 2 * sum(h * d for h, d in self.layer_kv) * dtype_bytes
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes


@dataclass(slots=True, frozen=True)
class LongRopeRows:
    """Which rows of a longrope model's RoPE tables its tokens read (model/families/longrope.py):
    rows 0..offset - 1 hold the short factors' cos and sin, rows offset.. the long factors'. A row
    of more than `original` tokens (prompt and generated so far) runs on the long factors,
    every token of it: what transformers' generate does for that row alone. Plain data: the
    step packer and the engine use it."""

    original: int  # original_max_position_embeddings
    offset: int  # max_position_embeddings: the first row of the long factors' table

    def is_long(self, tokens: int) -> bool:
        """Whether a row of `tokens` tokens runs on the long factors."""
        return tokens > self.original

    def rows(self, tokens: int, start: int, stop: int) -> range:
        """The table rows of positions start..stop - 1 of a row of `tokens` tokens."""
        shift = self.offset if self.is_long(tokens) else 0
        return range(start + shift, stop + shift)
