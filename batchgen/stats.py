"""Run statistics: counted as the job goes, derived rates as properties, printed as a
table and written to stats.json."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(slots=True)
class RunStats:
    rows: int = 0  # rows written in this run (ok + error)
    rows_error: int = 0
    rows_skipped_done: int = 0  # already in the output from an earlier run
    prompt_tokens: int = 0  # real prompt tokens of the rows run
    computed_prompt_tokens: int = 0  # including bucket and batch padding
    output_tokens: int = 0
    batches: int = 0
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0
    decode_steps: int = 0
    peak_memory_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # model, device, quantization, gpu, ...

    def finish(self) -> None:
        self.wall_s = time.perf_counter() - self.started

    @property
    def elapsed(self) -> float:
        return self.wall_s or time.perf_counter() - self.started

    @property
    def padding_efficiency(self) -> float:
        return (
            self.prompt_tokens / self.computed_prompt_tokens if self.computed_prompt_tokens else 1.0
        )

    def rate(self, n: float) -> float:
        return n / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("started")
        extra = d.pop("extra")
        d.update(
            rows_per_s=self.rate(self.rows),
            prompt_tokens_per_s=self.rate(self.prompt_tokens),
            output_tokens_per_s=self.rate(self.output_tokens),
            decode_tokens_per_s=self.output_tokens / self.decode_s if self.decode_s else 0.0,
            padding_efficiency=self.padding_efficiency,
        )
        return {**d, **extra}

    def table(self) -> str:
        d = self.to_dict()
        rows = [
            (
                "rows",
                f"{self.rows} ({self.rows_error} errors, {self.rows_skipped_done} done before)",
            ),
            ("wall time", f"{self.elapsed:.2f} s"),
            ("rows/s", f"{d['rows_per_s']:.2f}"),
            ("prompt tokens/s", f"{d['prompt_tokens_per_s']:.1f}"),
            ("output tokens/s", f"{d['output_tokens_per_s']:.1f}"),
            ("prefill / decode", f"{self.prefill_s:.2f} s / {self.decode_s:.2f} s"),
            ("compile + warm-up", f"{self.compile_s:.2f} s"),
            ("model load", f"{self.load_s:.2f} s"),
            ("padding efficiency", f"{self.padding_efficiency:.1%}"),
            ("peak memory", f"{self.peak_memory_bytes / 2**20:.0f} MiB"),
        ]
        if d.get("gpu_util_mean_pct") is not None:
            rows.append(
                ("GPU util mean/max", f"{d['gpu_util_mean_pct']:.0f}% / {d['gpu_util_max_pct']}%")
            )
            rows.append(("GPU memory max", f"{d['gpu_mem_used_max_bytes'] / 2**30:.2f} GiB"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
