"""Run statistics: the sum of the engine's step reports and the job's row counts, derived
rates as properties, printed as a table and written to _stats.json."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from batchgen.engine.engine import StepReport


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
    computed_prompt_tokens: int = 0  # prompt tokens run through the model (recomputes included)
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    output_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0  # steps with no prompt tokens
    decode_rows: int = 0  # sequence-steps that decoded a token
    padded_rows: int = 0  # decode rows computed only to fill a compiled shape
    preemptions: int = 0
    load_s: float = 0.0
    prefill_s: float = 0.0  # steps with prompt tokens (decodes riding along included)
    decode_s: float = 0.0
    compile_s: float = 0.0
    peak_memory_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # model, device, quantization, gpu, ...

    def add_error_rows(self, n: int) -> None:
        """Rows that became error records before reaching the engine."""
        self.rows += n
        self.rows_error += n

    def add_step(self, r: StepReport) -> None:
        """One engine step: the rows it finished and what it ran."""
        self.rows += len(r.finished)
        self.rows_error += sum(c.error is not None for c in r.finished)
        self.prompt_tokens += sum(c.prompt_tokens for c in r.finished)
        self.output_tokens += sum(c.completion_tokens for c in r.finished)
        if not (r.prompt_tokens or r.decode_rows):  # only rows rejected before running
            return
        self.steps += 1
        self.decode_steps += not r.prefill
        self.computed_prompt_tokens += r.prompt_tokens
        self.cached_prompt_tokens += r.cached_tokens
        self.decode_rows += r.decode_rows
        self.padded_rows += r.padded_rows
        self.preemptions += r.preempted
        self.compile_s += r.compile_seconds
        if r.prefill:
            self.prefill_s += r.seconds
        else:
            self.decode_s += r.seconds

    def finish(self) -> None:
        self.wall_s = time.perf_counter() - self.started

    @property
    def elapsed(self) -> float:
        return self.wall_s or time.perf_counter() - self.started

    @property
    def prompt_compute_ratio(self) -> float:
        """Prompt tokens computed / real: below 1 with prefix-cache hits, above with padding
        or recomputes after preemption."""
        return self.computed_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_live_share(self) -> float:
        """Decode rows that were live sequences, not shape padding."""
        total = self.decode_rows + self.padded_rows
        return self.decode_rows / total if total else 1.0

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
            prompt_compute_ratio=self.prompt_compute_ratio,
            decode_live_share=self.decode_live_share,
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
            (
                "prompt tokens computed",
                f"{self.prompt_compute_ratio:.1%} of real ({self.cached_prompt_tokens} from the prefix cache)",
            ),
            ("decode rows live", f"{self.decode_live_share:.1%} ({self.preemptions} preemptions)"),
            ("peak memory", f"{self.peak_memory_bytes / 2**20:.0f} MiB"),
        ]
        if d.get("gpu_util_mean_pct") is not None:
            rows.append(
                ("GPU util mean/max", f"{d['gpu_util_mean_pct']:.0f}% / {d['gpu_util_max_pct']}%")
            )
            rows.append(("GPU memory max", f"{d['gpu_mem_used_max_bytes'] / 2**30:.2f} GiB"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
