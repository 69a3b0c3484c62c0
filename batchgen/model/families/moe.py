"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): each token runs through k of E experts.

Per token x (dim,): the router's logits (E,) -> softmax in float32 -> the top k experts and
their probabilities -> renormalised to sum to 1 (`norm_topk_prob`; Mixtral always) -> the
output is the sum over the k picked experts e of p_e * down_e(act(gate_e x) * up_e x). This
is transformers' computation step for step (the routing weights cast to the model dtype
before the product for Qwen3-MoE, kept in float32 for Mixtral, as there), and each token's
experts are added from zeros in ascending expert order as transformers' loop adds them, so
float32 tokens equal transformers'.

The experts' weights are 3-D: `w_in` (E, 2 x I, dim) holds each expert's [gate; up] rows,
`w_out` (E, dim, I) its down projection, (out, in) as nn.Linear's; the loader stacks the
checkpoint's per-expert matrices into them (model/checkpoint/moe_names.py). With tensor parallelism
each rank holds every expert's 1/N of I (model/parallel/sharding.py) and the layer's output is a
partial sum, all-reduced once (model/parallel/collectives.py), as a dense MLP's; the router is
replicated.

The experts run in one custom op, `batchgen::moe_experts`, opaque to the compiler, as the
attention ops are (model/attention/decode_ops.py): how many tokens each expert gets is data, and a
graph over a symbolic batch cannot hold shapes that depend on it (a per-expert loop indexes
a data-dependent number of rows; torch 2.13's grouped_mm traces only in bfloat16, its fake
kernel refuses float32). Inside the op each device takes its best kernel:

  - grouped: the (token, expert) pairs sorted by expert, one `torch._grouped_mm` for every
    expert's [gate; up] and one for down (CPU, any float dtype; CUDA bfloat16 on sm80+);
  - loop: per expert, its rows gathered, two matmuls, added back (the rest, and sizes whose
    rows are not 16-byte multiples, which grouped_mm refuses); while a CUDA graph is being
    captured, where the loop's host sync cannot be, every expert on every token (dense).

Measured on this 2-core CPU in float32 (scripts/bench_moe.py, docs/benchmarks.md; a busy
machine, medians of alternating calls, 16 experts 4 a token and 64 experts 8 a token): on one
thread grouped was 1.04-1.57x the loop's speed from 1 to 256 tokens and the loop 1.02-1.18x
faster at 1024 (on two, grouped led there too), with the same values bit for bit; decode
batches are at most 256 rows, so the CPU takes grouped at every token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.model.config import Family, ModelConfig
from batchgen.model.families.activations import activation


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i = cfg.n_experts, cfg.moe_intermediate_size
        self.top_k, self.renorm = cfg.experts_per_token, cfg.norm_topk_prob
        self.act = cfg.activation
        self.float_weights = cfg.family == Family.MIXTRAL  # see the module's docstring
        self.router = nn.Linear(cfg.dim, e, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, 2 * i, cfg.dim))  # per expert [gate; up]
        self.w_out = nn.Parameter(torch.empty(e, cfg.dim, i))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> each token's expert weights and experts, (T, k) each."""
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        # traced: the op; eager: the same function without the op's dispatch
        run = moe_experts if torch.compiler.is_compiling() else run_experts
        return run(x, self.w_in, self.w_out, weights, experts, self.act)

    def extra_repr(self) -> str:
        e, two_i, dim = self.w_in.shape
        return f"experts={e}, top_k={self.top_k}, dim={dim}, intermediate={two_i // 2}"


def _sorted_by_expert(experts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts (T, k) -> the (token, slot) pairs' flat indices sorted by expert (stable: by
    token within an expert), and each expert's count (n,). No host sync (bincount's output
    size would need one), so a CUDA graph can capture it."""
    flat = experts.reshape(-1)
    counts = torch.zeros(n, dtype=torch.int64, device=flat.device)
    return flat.argsort(stable=True), counts.scatter_add_(0, flat, torch.ones_like(flat))


def experts_grouped(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """The experts' outputs summed per token (T, dim), as two grouped matmuls over the
    (token, expert) pairs sorted by expert (T x k rows, E groups)."""
    k = experts.shape[1]
    order, counts = _sorted_by_expert(experts, w_in.shape[0])
    offs = counts.cumsum(0).to(torch.int32)  # where each expert's rows end
    rows = order // k  # each pair's token
    h = F.grouped_mm(x[rows], w_in.transpose(1, 2), offs=offs)  # (T*k, 2I)
    gate, up = h.chunk(2, dim=-1)
    y = F.grouped_mm(activation(act, gate) * up, w_out.transpose(1, 2), offs=offs)  # (T*k, dim)
    y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


def experts_loop(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """experts_grouped's values, one expert at a time (one host sync for the counts)."""
    k = experts.shape[1]
    order, counts = _sorted_by_expert(experts, w_in.shape[0])
    flat_weights = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            pairs = order[start : start + n]
            rows = pairs // k
            gate, up = F.linear(x[rows], w_in[e]).chunk(2, dim=-1)
            y = F.linear(activation(act, gate) * up, w_out[e])
            out.index_add_(0, rows, (y * flat_weights[pairs, None]).to(x.dtype))
        start += n
    return out


def experts_dense(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """Every expert on every token, those not picked weighted 0: E/k times the FLOPs, and
    (T, E, 2I) in memory, but no shape depends on the routing. Only where a CUDA graph is
    being captured and grouped_mm cannot run (float16/float32, GPUs before sm80): the
    loop's host sync cannot be captured."""
    gates = torch.zeros(x.shape[0], w_in.shape[0], dtype=weights.dtype, device=x.device)
    gates.scatter_(1, experts, weights)  # (T, E)
    gate, up = torch.einsum("td,eod->teo", x, w_in).chunk(2, dim=-1)  # (T, E, I) each
    y = torch.einsum("tei,edi->ted", activation(act, gate) * up, w_out)  # (T, E, dim)
    return (y * gates[..., None]).sum(dim=1).to(x.dtype)


def grouped_runs(x: torch.Tensor, intermediate: int) -> bool:
    """Whether experts_grouped runs here: grouped_mm's kernels take any float dtype on the
    CPU, bfloat16 on CUDA from sm80, and rows that are multiples of 16 bytes."""
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu":
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], intermediate))


def run_experts(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """x (T, dim); w_in (E, 2I, dim), w_out (E, dim, I); weights, experts (T, k) -> the
    weighted sum of each token's experts' outputs (T, dim), by the kernel that runs here."""
    if grouped_runs(x, w_out.shape[-1]):
        kernel = experts_grouped
    elif x.is_cuda and torch.cuda.is_current_stream_capturing():
        kernel = experts_dense
    else:
        kernel = experts_loop
    return kernel(x, w_in, w_out, weights, experts, act)


@torch.library.custom_op("batchgen::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """run_experts as an op of its own, for a traced graph."""
    return run_experts(x, w_in, w_out, weights, experts, act)


@moe_experts.register_fake
def _(x, w_in, w_out, weights, experts, act):
    return torch.empty_like(x)
