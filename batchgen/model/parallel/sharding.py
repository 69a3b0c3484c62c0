"""Tensor parallelism, Megatron style: which part of every weight each of N ranks holds.

Rank r of N builds the decoder from `local_config`: 1/N of the query heads, 1/N of the KV
heads (or one replicated KV head where there are fewer KV heads than ranks, as vLLM does),
1/N of the MLP's intermediate features and 1/N of the vocabulary, and loads only those
slices (`copies`, used by the loader and the LoRA merge):

  - column-parallel (split over output rows): q/k/v (fused `wqkv`, each of q, k, v cut by
    heads), gate/up (fused `w_in`), their biases; a MoE layer's every expert's gate/up;
  - row-parallel (split over input columns): `wo` and `w_out` (a MoE layer's every expert's
    down), each followed by one all-reduce (model/parallel/collectives.py; a MoE layer's after its
    sum over experts); their bias is added once, by rank 0 (the others hold zeros);
  - vocabulary-parallel: the embedding (each rank looks up its rows, an all-reduce adds them)
    and the LM head (each rank's logits over its rows, all-gathered); tied stay tied;
  - replicated: norms, q/k norms (per head dim), GPT-2's position table, MoE routers.

Sizes N does not divide are refused before any weight loads (`check_sizes`), naming the N
that would work. The same arithmetic serves the loader (checkpoint tensors -> local slices),
the LoRA merge (slices of A or B), and the memory plan (bytes per rank).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TPShard:
    """This process's place among the tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size} tensor-parallel ranks")

    def split(self, n: int) -> slice:
        """This rank's even 1/size of range(n)."""
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)


@dataclass(frozen=True, slots=True)
class Copy:
    """One slice of a checkpoint tensor into a local parameter. In our (out, in) orientation
    (GPT-2's Conv1D weights transposed): take `src` along `dim` (None: all of it) and write
    it to rows `dst` of the local parameter (None: the whole parameter; a tuple: an index of
    a 3-D expert weight, e.g. (expert, rows)); `zero`: the local parameter is zeros (a
    row-parallel bias on ranks other than 0)."""

    dim: int = 0
    src: slice | None = None
    dst: slice | tuple[int | slice, ...] | None = None
    zero: bool = False


WHOLE = (Copy(),)
SINGLE = TPShard()  # one rank: the whole model


def size_problems(cfg: ModelConfig, n: int) -> list[str]:
    """Why n ranks cannot split cfg's sizes; empty when they can."""
    sizes = [("attention heads", cfg.n_heads), ("vocabulary", cfg.vocab_size)]
    if cfg.n_moe_layers < cfg.n_layers:  # a dense MLP somewhere
        sizes.append(("intermediate size", cfg.intermediate_size))
    if cfg.n_experts:
        sizes.append(("expert intermediate size", cfg.moe_intermediate_size))
    bad = [f"{name} {value}" for name, value in sizes if value % n]
    if cfg.n_kv_heads % n and n % cfg.n_kv_heads:  # fewer KV heads than ranks: replicated
        bad.append(f"KV heads {cfg.n_kv_heads} (neither divides the other)")
    return bad


def valid_sizes(cfg: ModelConfig, upto: int = 16) -> list[int]:
    return [n for n in range(1, upto + 1) if not size_problems(cfg, n)]


def check_sizes(cfg: ModelConfig, n: int) -> None:
    """ValueError naming the sizes n does not divide and the sizes that would work."""
    bad = size_problems(cfg, n)
    if bad:
        raise ValueError(
            f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}; "
            f"sizes that work: {', '.join(map(str, valid_sizes(cfg)))}"
        )


def local_kv_heads(cfg: ModelConfig, tp: TPShard) -> int:
    return max(1, cfg.n_kv_heads // tp.size)


def kv_head_start(cfg: ModelConfig, tp: TPShard) -> int:
    """The first KV head rank tp holds: its own 1/N, or with fewer KV heads than ranks the one
    its query heads use (rank r // (N / KV heads))."""
    if cfg.n_kv_heads >= tp.size:
        return tp.rank * (cfg.n_kv_heads // tp.size)
    return tp.rank // (tp.size // cfg.n_kv_heads)


def local_config(cfg: ModelConfig, tp: TPShard) -> ModelConfig:
    """The architecture of rank tp's part of the model (cfg itself at size 1)."""
    if tp.size == 1:
        return cfg
    check_sizes(cfg, tp.size)
    return dataclasses.replace(
        cfg,
        vocab_size=cfg.vocab_size // tp.size,
        n_heads=cfg.n_heads // tp.size,
        n_kv_heads=local_kv_heads(cfg, tp),
        intermediate_size=max(1, cfg.intermediate_size // tp.size),
        moe_intermediate_size=cfg.moe_intermediate_size // tp.size,
    )


def qkv_copies(cfg: ModelConfig, tp: TPShard, pieces: str) -> tuple[Copy, ...]:
    """Copies of q/k/v rows into the local fused wqkv: `pieces` "q", "k", "v" (a separate
    checkpoint tensor each) or "qkv" (GPT-2's fused c_attn, its rows q|k|v)."""
    d, local = cfg.head_dim, local_config(cfg, tp)
    q, kv = cfg.n_heads * d, cfg.n_kv_heads * d  # rows of each in the checkpoint
    ql, kvl = local.n_heads * d, local.n_kv_heads * d  # and locally
    k0 = kv_head_start(cfg, tp) * d
    ranges = {
        "q": (0, tp.split(cfg.n_heads), slice(0, ql)),
        "k": (q, slice(k0 // d, k0 // d + local.n_kv_heads), slice(ql, ql + kvl)),
        "v": (q + kv, slice(k0 // d, k0 // d + local.n_kv_heads), slice(ql + kvl, ql + 2 * kvl)),
    }
    fused = pieces == "qkv"
    out = []
    for p in "qkv" if fused else pieces:
        base, heads, dst = ranges[p]
        start = (base if fused else 0) + heads.start * d
        out.append(Copy(0, slice(start, start + (heads.stop - heads.start) * d), dst))
    return tuple(out)


def gate_up_copies(cfg: ModelConfig, tp: TPShard, pieces: str) -> tuple[Copy, ...]:
    """Copies into the local w_in: "gate", "up" (Llama, fused [gate; up] locally), "gate_up"
    (Phi-3's gate_up_proj, [gate; up] already) or "in" (GPT-2's c_fc, not gated)."""
    local = tp.split(cfg.intermediate_size)
    k = local.stop - local.start
    if pieces == "in":
        return (Copy(0, local, None),)
    if pieces == "gate_up":  # this rank's gate rows, then its up rows
        if tp.size == 1:
            return WHOLE
        up = slice(cfg.intermediate_size + local.start, cfg.intermediate_size + local.stop)
        return (Copy(0, local, slice(0, k)), Copy(0, up, slice(k, 2 * k)))
    dst = slice(0, k) if pieces == "gate" else slice(k, 2 * k)
    return (Copy(0, local if tp.size > 1 else None, dst),)


def expert_copies(
    cfg: ModelConfig, tp: TPShard, piece: str, expert: int | None
) -> tuple[Copy, ...]:
    """Copies into a MoE layer's local w_in (E, 2 x I/N, dim) or w_out (E, dim, I/N): piece
    "gate", "up" or "down" of one expert (a 2-D checkpoint tensor), or with expert None the
    3-D tensor of all of them ("gate_up": [gate; up] rows, or "down")."""
    i = cfg.moe_intermediate_size
    part = tp.split(i)
    k = part.stop - part.start
    src = part if tp.size > 1 else None
    if expert is None and piece == "down":
        return (Copy(2, src),)
    if expert is None:  # (E, 2I, dim): this rank's gate rows, then its up rows
        if tp.size == 1:
            return WHOLE
        every = slice(None)
        up = slice(i + part.start, i + part.stop)
        return (Copy(1, part, (every, slice(0, k))), Copy(1, up, (every, slice(k, 2 * k))))
    if piece == "down":
        return (Copy(1, src, (expert,)),)
    return (Copy(0, src, (expert, slice(0, k) if piece == "gate" else slice(k, 2 * k))),)


def row_parallel_copies(n_in: int, tp: TPShard, bias: bool) -> tuple[Copy, ...]:
    """wo / w_out: input columns split; the bias once, on rank 0."""
    if bias:
        return WHOLE if tp.rank == 0 else (Copy(zero=True),)
    return (Copy(1, tp.split(n_in)),)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, size: int = 1) -> int:
    """Bytes of the parameters one of `size` ranks holds, from the config alone (unquantized;
    tied embeddings once; norms left out)."""
    return local_config(cfg, TPShard(0, size)).num_params * dtype_bytes
