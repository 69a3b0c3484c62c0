"""Architecture description of a decoder, independent of any file format.

`ModelConfig` says *what* to build; `batchgen.model.hf_config` knows how Hugging Face
`config.json` files map onto it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from batchgen.choices import ModelImpl


class Family(str, enum.Enum):
    GPT2 = "gpt2"
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"


class NormKind(str, enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class PositionKind(str, enum.Enum):
    ROPE = "rope"  # rotary, computed from per-row positions
    LEARNED = "learned"  # GPT-2's absolute position table


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind is "default", "linear" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    SUPPORTED = ("default", "linear", "llama3")

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
    activation: str = "silu"  # "silu" | "gelu_tanh" | "gelu"
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
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def num_params(self) -> int:
        if self.param_count is not None:
            return self.param_count
        attn = self.dim * self.qkv_dim + self.n_heads * self.head_dim * self.dim
        mlp = (3 if self.gated_mlp else 2) * self.dim * self.intermediate_size
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp) + embed

    @property
    def rope_table_bytes(self) -> int:
        """Peak bytes of building the float32 RoPE tables (rope.rope_tables): the (P, D/2)
        frequencies, the (P, D) angles, and the cos and sin tables, P positions long."""
        if self.position != PositionKind.ROPE:
            return 0
        return int(self.max_position_embeddings * self.head_dim * 4 * 3.5)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token of one row occupies, across all layers."""
        if self.layer_kv:
            return 2 * sum(h * d for h, d in self.layer_kv) * dtype_bytes
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes
