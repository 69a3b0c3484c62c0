"""The error-rate verdict on a complete output: its rows and error rows (every record with an
`error`: a failed row, a constrained row cut short, ...) counted from the part files, so a
resumed job's earlier runs count too, against --max-error-rate.

It is written to VERDICT_FILE just before SUCCESS, and again by every rerun of the complete
job: SUCCESS says every row is there exactly once; the verdict says whether they pass. A retry
(Make, Airflow, a Slurm requeue) of a job that failed on its error rate fails the same way,
until the user accepts the rate (--max-error-rate 1)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.layout import VERDICT_FILE, write_file


def error_reason(error: str) -> str:
    """An error's reason, its numbers as N ("prompt of N tokens ..."): rows group by it."""
    return re.sub(r"\d+(\.\d+)?", "N", error)[:200]


def reason_lines(reasons: dict[str, int], listed_in: str, most: int = 5) -> list[str]:
    """The commonest error reasons with their counts, for the end of a run; the others are
    in the file listed_in."""
    top = sorted(reasons.items(), key=lambda kv: -kv[1])
    lines = [f"  {n:>6} x {reason}" for reason, n in top[:most]]
    if len(top) > most:
        rest = sum(n for _, n in top[most:])
        lines.append(f"  {rest:>6} x {len(top) - most} other reasons ({listed_in})")
    return lines


@dataclass(frozen=True, slots=True)
class ErrorVerdict:
    rows: int
    error_rows: int
    max_error_rate: float
    reasons: dict[str, int] = field(default_factory=dict)  # error rows by reason

    @classmethod
    def count(cls, parts: Iterable[str], max_error_rate: float) -> ErrorVerdict:
        """The verdict on the records in these part files."""
        rows, reasons = 0, {}
        for part in parts:
            errors = pq.read_table(part, columns=["error"]).column("error")
            rows += len(errors)
            for item in pc.value_counts(errors.drop_null()).to_pylist():  # distinct texts
                reason = error_reason(item["values"])
                reasons[reason] = reasons.get(reason, 0) + item["counts"]
        return cls(rows, sum(reasons.values()), max_error_rate, reasons)

    @property
    def rate(self) -> float:
        return self.error_rows / self.rows if self.rows else 0.0

    @property
    def passed(self) -> bool:
        return self.rate <= self.max_error_rate

    def line(self) -> str:
        """What a failed verdict says, the same on every rerun."""
        return (
            f"{self.error_rows} of {self.rows} rows ({self.rate:.0%}) are error rows, over "
            f"--max-error-rate {self.max_error_rate:g} (every row is written); fix the reasons "
            "above, or pass --max-error-rate 1 to accept them"
        )

    def reason_lines(self) -> list[str]:
        return reason_lines(self.reasons, VERDICT_FILE)

    def to_dict(self) -> dict:
        return {**asdict(self), "error_rate": self.rate, "passed": self.passed}


def record_verdict(
    directory: str | os.PathLike[str], parts: Iterable[str], max_error_rate: float
) -> ErrorVerdict:
    """The verdict on the records in these part files, written to directory/VERDICT_FILE (a
    run's own parts, or a merged job's shards')."""
    verdict = ErrorVerdict.count(parts, max_error_rate)
    data = json.dumps(verdict.to_dict(), indent=2, sort_keys=True).encode() + b"\n"
    write_file(directory, VERDICT_FILE, lambda f: f.write(data))
    return verdict
