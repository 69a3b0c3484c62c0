"""Length-bucketed batch planning: plain Python, no torch.

Prompts are sorted by token length and cut into batches whose shapes come from a
bounded set, so the compiled model sees a handful of static shapes:

- prompt lengths round up to a bucket edge: powers of two from `min_bucket`, capped at
  `max_prompt_len` (the last edge);
- batch sizes are powers of two up to `max_batch`; a bucket's batch size is the largest
  one whose prompt tokens fit `prefill_token_budget` and whose KV rows (prompt bucket +
  new-token bucket) fit `kv_capacity_tokens`, so short prompts run in big batches and
  long ones in small batches;
- new-token counts round up to a power of two (at least 16) and set the cache row length.

Within a bucket, rows are ordered by their max_new_tokens, so a batch holds rows of
similar output length. A partial last batch of a bucket is padded up to the next batch
size with dummy rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(slots=True, frozen=True)
class BucketConfig:
    max_prompt_len: int = 1024
    min_bucket: int = 16
    max_batch: int = 64
    prefill_token_budget: int = 16384
    kv_capacity_tokens: int = 65536
    min_new_bucket: int = 16

    def __post_init__(self) -> None:
        if self.min_bucket < 1 or self.max_prompt_len < 1:
            raise ValueError("min_bucket and max_prompt_len must be >= 1")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    @property
    def prompt_edges(self) -> list[int]:
        edges, e = [], min(self.min_bucket, self.max_prompt_len)
        while e < self.max_prompt_len:
            edges.append(e)
            e *= 2
        return [*edges, self.max_prompt_len]

    def prompt_bucket(self, length: int) -> int:
        if length > self.max_prompt_len:
            raise ValueError(
                f"prompt of {length} tokens exceeds max_prompt_len {self.max_prompt_len}"
            )
        return next(e for e in self.prompt_edges if e >= length)

    def new_tokens_bucket(self, max_new: int) -> int:
        return max(self.min_new_bucket, next_pow2(max_new))

    def batch_size(self, prompt_len: int, new_bucket: int) -> int:
        """Largest power-of-two batch whose prefill and KV rows fit the budgets (>= 1)."""
        fit = min(
            self.max_batch,
            self.prefill_token_budget // prompt_len,
            self.kv_capacity_tokens // (prompt_len + new_bucket),
        )
        return max(1, 1 << (max(fit, 1).bit_length() - 1))

    def padded_batch(self, n: int, limit: int) -> int:
        return min(next_pow2(n), limit)


@dataclass(slots=True, frozen=True)
class BatchPlan:
    indices: tuple[int, ...]  # positions of the real rows in the planned list
    prompt_len: int  # bucket edge: every row is left-padded to this
    batch_size: int  # compiled batch size, >= len(indices)
    max_new: int  # new-token bucket: cache rows are prompt_len + max_new long

    @property
    def row_stride(self) -> int:
        return self.prompt_len + self.max_new

    @property
    def kv_tokens(self) -> int:
        return self.batch_size * self.row_stride

    @property
    def computed_prompt_tokens(self) -> int:
        return self.batch_size * self.prompt_len  # padding rows and tokens included


@dataclass(slots=True)
class Plan:
    batches: list[BatchPlan]
    real_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0  # including padding tokens and padding rows
    histogram: Counter = field(default_factory=Counter)  # bucket edge -> rows

    @property
    def padding_efficiency(self) -> float:
        return (
            self.real_prompt_tokens / self.computed_prompt_tokens
            if self.computed_prompt_tokens
            else 1.0
        )

    @property
    def shapes(self) -> set[tuple[int, int, int]]:
        return {(b.batch_size, b.prompt_len, b.max_new) for b in self.batches}

    @property
    def max_kv_tokens(self) -> int:
        return max((b.kv_tokens for b in self.batches), default=0)


def plan_batches(prompt_lens: list[int], max_new: list[int], cfg: BucketConfig) -> Plan:
    """Group rows (by position) into length-bucketed batches; longest buckets first so
    the biggest shapes compile, and fail, early."""
    # Within a bucket, rows with similar output lengths share a batch: a static batch runs
    # until its longest row finishes, so mixing 16- and 256-token rows wastes decode steps.
    order = sorted(range(len(prompt_lens)), key=lambda i: (max_new[i], prompt_lens[i], i))
    by_bucket: dict[int, list[int]] = {}
    for i in order:
        by_bucket.setdefault(cfg.prompt_bucket(prompt_lens[i]), []).append(i)
    plan = Plan(batches=[])
    for edge in sorted(by_bucket, reverse=True):
        rows = by_bucket[edge]
        plan.histogram[edge] = len(rows)
        new_bucket = cfg.new_tokens_bucket(max(max_new[i] for i in rows))
        size = cfg.batch_size(edge, new_bucket)
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            b = cfg.padded_batch(len(chunk), size)
            plan.batches.append(BatchPlan(tuple(chunk), edge, b, new_bucket))
            plan.real_prompt_tokens += sum(prompt_lens[i] for i in chunk)
            plan.computed_prompt_tokens += b * edge
    return plan
