"""The collectives of a tensor-parallel decoder, added to a built (and quantized) model the way
gpt-fast's tp.py does it, so families/transformer.py stays the single-device model:

  - the embedding looks up only the rank's vocabulary rows (zeros elsewhere) and an
    all-reduce adds the ranks' rows: each token's row comes from exactly one rank;
  - `wo` and `w_out` are row-parallel: each rank's output is a partial sum, completed by an
    all-reduce (a forward hook) before the residual add; a MoE layer's (model/families/moe.py) after
    its weighted sum over the experts, each holding 1/N of every expert;
  - the LM head gives each rank the logits of its vocabulary rows; an all-gather puts the
    rows side by side, so every rank holds the whole (S, vocab) logits.

Collectives are torch's functional collectives: plain ops in a traced graph, so the compiled
decode step stays one graph and on CUDA its CUDA graph captures the NCCL calls. Per token
(hidden size h, 2 bytes) each layer all-reduces 2 x h values, plus one for the embedding; the
LM head gathers its vocabulary (docs/architecture.md has the bytes at 8B and 70B shapes).

Where the forward runs eagerly on the CPU (gloo, whose collectives block), the wall time spent
in them is summed in a `CollectiveClock`, for the run's statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol

from batchgen.model.families.moe import MoE
from batchgen.model.families.transformer import Transformer
from batchgen.model.parallel.sharding import TPShard


@dataclass(slots=True)
class CollectiveClock:
    """Wall seconds spent in collectives, where they can be timed (eager, on the CPU)."""

    seconds: float = 0.0


class _Collectives:
    def __init__(self, group: ProcessGroup, size: int, clock: CollectiveClock | None) -> None:
        self.group, self.size, self.clock = group, size, clock

    def _waited(self, y: torch.Tensor, t0: float | None) -> torch.Tensor:
        """Eager: the collective waited here (and timed, with a clock), not at its
        AsyncCollectiveTensor's first use: a follower rank never reads its gathered logits,
        and torch warns at exit of each collective never waited ("unwaited collective
        calls"). A traced graph gets its waits from the compiler (t0 None: not timed)."""
        if t0 is None:
            return y
        y = funcol.wait_tensor(y)
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - t0
        return y

    @staticmethod
    def _start() -> float | None:
        """The clock's start, eager only: time.perf_counter() inside a compiled forward
        failed its trace (fullgraph), so a traced call reads no clock."""
        return None if torch.compiler.is_compiling() else time.perf_counter()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = self._start()
        return self._waited(funcol.all_reduce(x, "sum", self.group), t0)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """(S, V/N) on each rank -> (S, V), ranks' columns in rank order."""
        t0 = self._start()
        return self._waited(funcol.all_gather_single(x.contiguous(), 1, self.group), t0)


class VocabParallelEmbedding(nn.Module):
    """An embedding over rows [start, start + n) of the vocabulary; its weight is the rank's
    shard (the Parameter of the embedding it replaces, so a tied LM head stays tied)."""

    def __init__(self, weight: nn.Parameter, start: int, comm: _Collectives) -> None:
        super().__init__()
        self.weight, self.start, self.comm = weight, start, comm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(inside, local, 0), self.weight)  # (T, dim)
        return self.comm.all_reduce(x * inside[:, None].to(x.dtype))


def apply_tensor_parallel(
    model: Transformer, tp: TPShard, group: ProcessGroup, clock: CollectiveClock | None = None
) -> None:
    """Add rank tp's collectives to its part of the model (built from local_config, loaded
    with its slices, quantized or not)."""
    comm = _Collectives(group, tp.size, clock)
    vocab = model.embed.weight.shape[0]  # this rank's rows
    model.embed = VocabParallelEmbedding(model.embed.weight, tp.rank * vocab, comm)
    for block in model.layers:
        # a MoE layer's output is the partial sum of every expert's down rows: one all-reduce
        mlp_out = block.mlp if isinstance(block.mlp, MoE) else block.mlp.w_out
        for layer in (block.attn.wo, mlp_out):
            layer.register_forward_hook(lambda _m, _i, out: comm.all_reduce(out))
    model.lm_head.register_forward_hook(lambda _m, _i, out: comm.gather_columns(out))
