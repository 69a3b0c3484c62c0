"""Token sampling on the device, with per-row parameters and per-row seeds.

Randomness comes from a counter-based hash of (seed, step, vocab index) instead of a
generator's state, so a row draws the same noise whatever else is in its batch, and the
whole thing traces into one graph with no host round trip. Sampling uses the
exponential-race form of the Gumbel trick: argmax(p / E) with E ~ Exp(1) is a draw
from p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.sequence import Scheduled

# A row's banned tokens (its stop tokens while below min_tokens) are a (B, W) tensor of ids,
# -1 padded, W this or the next power of two above it: a fixed shape, so no recompiles.
BAN_WIDTH = 8

_M31 = (1 << 31) - 1
_MIX = 0x045D9F3B  # < 2**27, so (x < 2**31) * _MIX stays inside int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (two xorshift-multiply rounds); x in [0, 2**31)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M31
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M31
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) uniforms in (0, 1), a pure function of (seed, step, index)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    row = _mix((_mix(seeds) + (steps & 0xFFFFF) * 0x2545F491) & _M31)  # (B,)
    h = _mix(row[:, None] ^ _mix(idx)[None, :])  # (B, V)
    # Keep 23 bits: (k + 0.5) / 2**23 is exact in float32 and lies in [2**-24, 1 - 2**-24].
    # With all 31 bits, h.float() rounds the top values to 2**31 and u to exactly 1.0, so the
    # noise -log(u) is -0.0 and a filtered token (p = 0) gets 0 / -0.0 = NaN, which argmax picks.
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 23))


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, each (B,)."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    seed: torch.Tensor  # int64
    # optional (None: off) for callers that set neither; the steps' SamplingColumns always do,
    # so a compiled graph always sees tensors
    min_p: torch.Tensor | None = None  # float32; 0 = off
    ban: torch.Tensor | None = None  # (B, W) int64: token ids the row may not draw now; -1 = none


def ban_tokens(logits: torch.Tensor, ban: torch.Tensor | None) -> torch.Tensor:
    """logits with each row's banned ids (ban: packed first, -1 padded) at -inf: one scatter
    of (B, W) values, not a pass over (B, V). A padding slot repeats its row's first banned id
    with the same -inf, or, in a row that bans nothing, writes index 0's own logit back, so no
    two slots of a row write different values to one index."""
    if ban is None:
        return logits
    first = ban[:, :1]  # (B, 1): the row's first banned id, -1 if it bans nothing
    idx = torch.where(ban >= 0, ban, first.clamp(min=0))
    vals = torch.where(first >= 0, float("-inf"), logits.gather(-1, idx))
    return logits.scatter(-1, idx, vals)


def _filter(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None
) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    if min_p is not None:
        # first, as vLLM: p < min_p * p_max, i.e. logit < the top logit + log(min_p) (log 0 =
        # -inf drops nothing)
        floor = sorted_logits[:, :1] + torch.log(min_p)[:, None]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_logits.gather(-1, (k - 1)[:, None])  # (B, 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Drop a token once the mass before it already reaches top_p (the first one always stays).
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    steps: torch.Tensor,
    greedy_only: bool,
    filters: bool = True,
) -> torch.Tensor:
    """logits (B, V) float32 -> next tokens (B,) int64. steps (B,): tokens the row has
    generated so far, which (with its seed) picks its noise. filters: does a row ask for
    top-k, top-p or min-p (without, no sort over the vocabulary)."""
    # max's index, the first of equal maxima as argmax's, from a reduction ~3x faster than
    # argmax's on the CPU (192 x 32000 float32: 3 against 11 ms)
    greedy = logits.max(-1).indices
    if greedy_only:
        return greedy
    temp = torch.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / temp
    if filters:
        scaled = _filter(scaled, params.top_k, params.top_p, params.min_p)
    probs = scaled.softmax(-1)
    noise = -torch.log(row_uniforms(params.seed, steps, logits.shape[-1]))  # Exp(1)
    drawn = (probs / noise).max(-1).indices
    return torch.where(params.temperature > 0, drawn, greedy)


@dataclass(slots=True)
class SamplingColumns:
    """Host-side columns of the sampling rows of a step, padded to a compiled shape and
    turned into SamplingTensors."""

    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    seed: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # tokens the row generated so far
    min_p: list[float] = field(default_factory=list)
    ban: list[list[int]] = field(default_factory=list)  # stop tokens below min_tokens

    @classmethod
    def of(cls, sampled: list[Scheduled]) -> SamplingColumns:
        """The columns of the rows `sampled`, in order."""
        params = [s.seq.params for s in sampled]
        return cls(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            seed=[p.seed for p in params],
            steps=[s.seq.num_generated for s in sampled],
            min_p=[p.min_p for p in params],
            ban=[sorted(s.seq.stop_ids) if bans(s) else [] for s in sampled],
        )

    def pad(self, n: int) -> None:
        for col, fill in (
            (self.temperature, 0.0),
            (self.top_k, 0),
            (self.top_p, 1.0),
            (self.seed, 0),
            (self.steps, 0),
            (self.min_p, 0.0),
        ):
            col.extend([fill] * n)
        self.ban.extend([] for _ in range(n))

    def tensors(
        self, dev: torch.device, graph: bool = False
    ) -> tuple[SamplingTensors, torch.Tensor]:
        """The columns on the device. graph: for the compiled sampling graph, which takes the
        ban as an input every step; eagerly a step where no row bans a token has none (its
        (B, V) scatter costs ~1 ms a step at 256 rows on the CPU, greedy steps included)."""
        banned = any(self.ban)
        width = BAN_WIDTH
        while width < max(map(len, self.ban), default=0):
            width *= 2
        ban = [b + [-1] * (width - len(b)) for b in self.ban]
        return SamplingTensors(
            temperature=torch.tensor(self.temperature, dtype=torch.float32, device=dev),
            top_k=torch.tensor(self.top_k, dtype=torch.long, device=dev),
            top_p=torch.tensor(self.top_p, dtype=torch.float32, device=dev),
            seed=torch.tensor(self.seed, dtype=torch.long, device=dev),
            min_p=torch.tensor(self.min_p, dtype=torch.float32, device=dev),
            ban=(
                torch.tensor(ban, dtype=torch.long, device=dev).reshape(len(ban), width)
                if graph or banned
                else None
            ),
        ), torch.tensor(self.steps, dtype=torch.long, device=dev)

    @property
    def greedy_only(self) -> bool:
        return all(t == 0.0 for t in self.temperature)

    @property
    def filters(self) -> bool:
        """Does a sampled (not greedy) row ask for top-k, top-p or min-p?"""
        return any(
            t > 0.0 and (k > 0 or p < 1.0 or m > 0.0)
            for t, k, p, m in zip(self.temperature, self.top_k, self.top_p, self.min_p, strict=True)
        )


def bans(s: Scheduled) -> bool:
    """Does the row ban tokens this step (its stop tokens while below min_tokens)?"""
    return s.seq.params.min_tokens > 0 and s.seq.below_min_tokens


def plain_greedy(sampled: list[Scheduled]) -> bool:
    """Is every row greedy, banning nothing: its token is the argmax, nothing else to pass?"""
    return not any(s.seq.params.temperature > 0.0 or bans(s) for s in sampled)
