"""Per-row latency: time to first token (TTFT), time per output token (TPOT), latency.

The engine stamps each sequence with `time.perf_counter()` at step boundaries it already has
(queue entry, the end of the step that sampled its first token, the end of the step that
finished it; engine/engine.py), so timing a row costs no extra host sync. For an offline job the
clock starts when a row enters the engine's queue: TTFT includes the time it waited there.

    ttft    = first token - queue entry
    latency = last token - queue entry
    tpot    = (latency - ttft) / (tokens - 1)     (rows of 2 tokens or more)

A run's distributions are kept as log-bucketed histograms (1% wide buckets): bounded memory
for ten million rows, percentiles within 0.5% of the exact value (mean and max are exact), and
shards' histograms add up, so merged percentiles are those of all the rows (scaleout/merge.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.sequence import Completion

TIMING_COLUMNS = ("queued_s", "ttft_s", "latency_s", "tpot_s")
METRICS = ("ttft_s", "tpot_s", "latency_s")
RATIO = 1.01  # bucket i holds [LOW * RATIO**i, LOW * RATIO**(i + 1))
LOW = 1e-6  # seconds; anything shorter counts as this


@dataclass(slots=True)
class LogHistogram:
    counts: dict[int, int] = field(default_factory=dict)
    n: int = 0
    total: float = 0.0
    low: float = math.inf
    high: float = 0.0

    def add(self, x: float) -> None:
        i = int(math.log(max(x, LOW) / LOW) / math.log(RATIO))
        self.counts[i] = self.counts.get(i, 0) + 1
        self.n += 1
        self.total += x
        self.low, self.high = min(self.low, x), max(self.high, x)

    def merge(self, other: LogHistogram) -> None:
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c
        self.n += other.n
        self.total += other.total
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank q-quantile: its bucket's geometric middle, within [min, max]."""
        if not self.n:
            return None
        rank, seen = max(1, math.ceil(q * self.n)), 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return min(max(LOW * RATIO ** (i + 0.5), self.low), self.high)
        return self.high

    def summary(self) -> dict[str, float | None]:
        mean = self.total / self.n if self.n else None
        return {
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "mean": mean,
            "max": self.high if self.n else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": RATIO,
            "low_s": LOW,
            "counts": {str(i): c for i, c in sorted(self.counts.items())},
            "sum": self.total,
            "min": self.low if self.n else None,
            "max": self.high if self.n else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogHistogram:
        if d.get("ratio") != RATIO or d.get("low_s") != LOW:
            raise ValueError(
                f"a histogram of another bucketing ({d.get('ratio')}, {d.get('low_s')})"
            )
        counts = {int(i): int(c) for i, c in d["counts"].items()}
        low = d["min"] if d["min"] is not None else math.inf
        return cls(counts, sum(counts.values()), float(d["sum"]), low, d["max"] or 0.0)


def row_timings(c: Completion, origin: float) -> dict[str, float | None]:
    """A completion's timing columns, in seconds (queued_s since `origin`, the job's start);
    all None for a row the engine did not run (an error)."""
    if c.error is not None or not c.queued_at:
        return dict.fromkeys(TIMING_COLUMNS)
    ttft, latency = c.first_token_at - c.queued_at, c.finished_at - c.queued_at
    n = c.completion_tokens
    return {
        "queued_s": c.queued_at - origin,
        "ttft_s": ttft,
        "latency_s": latency,
        "tpot_s": (latency - ttft) / (n - 1) if n > 1 else None,
    }


@dataclass(slots=True)
class Latencies:
    """The run's TTFT, TPOT and latency histograms, over the rows the engine ran."""

    hists: dict[str, LogHistogram] = field(
        default_factory=lambda: {k: LogHistogram() for k in METRICS}
    )

    def add(self, c: Completion) -> None:
        t = row_timings(c, 0.0)
        for k in METRICS:
            if t[k] is not None:
                self.hists[k].add(t[k])

    def merge(self, other: Latencies) -> None:
        for k in METRICS:
            self.hists[k].merge(other.hists[k])

    def summary(self) -> dict[str, dict[str, float | None]]:
        """stats.json's ttft_s, tpot_s and latency_s: {p50, p90, p99, mean, max} each."""
        return {k: self.hists[k].summary() for k in METRICS}

    def to_dict(self) -> dict[str, Any]:
        return {k: self.hists[k].to_dict() for k in METRICS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Latencies:
        return cls({k: LogHistogram.from_dict(d[k]) for k in METRICS})
