"""A MoE family's checkpoint names -> the 3-D expert weights of model/families/moe.py.

Two layouts are read. The hub's, which transformers 5.25's `save_pretrained` also writes (it
converts its fused weights back on save), has one matrix per expert:

    Qwen3-MoE  model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight
               router model.layers.{i}.mlp.gate.weight
    Mixtral    model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight (gate, up, down)
               router model.layers.{i}.block_sparse_moe.gate.weight

transformers' own (`save_pretrained(save_original_format=False)`) has them stacked:
`model.layers.{i}.mlp.experts.gate_up_proj` (E, 2I, dim), `...experts.down_proj` (E, dim, I)
and the router `model.layers.{i}.mlp.gate.weight`. Either way each tensor is copied straight
into its place in our `w_in` (E, 2I, dim) / `w_out` (E, dim, I) (this rank's part of it:
parallel.sharding.expert_copies), so no expert is ever held twice.
"""

from __future__ import annotations

import re

from batchgen.model.config import ModelConfig
from batchgen.model.parallel.sharding import WHOLE, Copy, TPShard, expert_copies

_PIECES = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
_OURS = re.compile(r"layers\.\d+\.mlp\.(?:w_in|w_out|router\.weight)")  # what moe_weight fills


def moe_weight(cfg: ModelConfig, name: str, tp: TPShard) -> tuple[str, tuple[Copy, ...]] | None:
    """Our parameter and the copies into it for a MoE layer's checkpoint tensor; None for a
    name that is not one (attention, norms, a dense layer's MLP)."""
    if m := _ROUTER.fullmatch(name):
        return f"layers.{m.group(1)}.mlp.router.weight", WHOLE
    if (m := _PER_EXPERT.fullmatch(name)) and m.group(3) in _PIECES:
        i, expert, piece = int(m.group(1)), int(m.group(2)), _PIECES[m.group(3)]
        ours = "w_out" if piece == "down" else "w_in"
        return f"layers.{i}.mlp.{ours}", expert_copies(cfg, tp, piece, expert)
    if m := _STACKED.fullmatch(name):
        piece = "down" if m.group(2) == "down_proj" else "gate_up"
        ours = "w_out" if piece == "down" else "w_in"
        return f"layers.{m.group(1)}.mlp.{ours}", expert_copies(cfg, tp, piece, None)
    return None


def is_moe_param(ours: str) -> bool:
    """Whether our parameter `ours` is a MoE layer's stacked experts or its router."""
    return _OURS.fullmatch(ours) is not None
