"""The engine's knobs, with the names vLLM users know (the KV pool's sizing rule that reads
them: engine/kv_sizing.py). Plain Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass

# On the CPU the pool is sized from the job: this many of its longest rows at once. More
# sequences than that run (max_num_seqs) while their rows are shorter: admission reserves each
# row's full length there (Scheduler reserve_full_rows), so none is preempted. Measured
# (docs/benchmarks.md): 256 sequences ran the mixed job 1.075x faster than 64, at the same
# memory; long-tail and a job of uniform long rows took the same time.
CPU_POOL_ROWS = 64


@dataclass(slots=True, frozen=True)
class EngineConfig:
    max_num_seqs: int = 256  # sequences in flight (the largest decode batch)
    max_num_batched_tokens: int = 2048  # tokens one step may run (decodes + prefill chunks)
    block_size: int = 16  # token slots per KV cache block
    kv_cache_tokens: int | None = None  # None: sized from the job (CPU) or free memory (GPU)
    # vLLM's meaning: the share of the GPU's total memory this process may use, weights,
    # activations and CUDA graphs included; the KV pool takes what is left of it
    gpu_memory_utilization: float = 0.9
    prefix_caching: bool = True  # reuse full blocks of earlier prompts with the same tokens
    read_ahead: int = 8192  # tokenized requests kept waiting; admitted longest first

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "read_ahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2 * self.block_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least 2 blocks ({2 * self.block_size}), "
                f"got {self.kv_cache_tokens}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def pool_rows(self) -> int:
        """Rows of the job's longest length a pool sized from the job holds (the CPU's)."""
        return min(self.max_num_seqs, CPU_POOL_ROWS)

    @classmethod
    def for_device(cls, device_type: str, compiled: bool = False, **overrides) -> EngineConfig:
        """Defaults per device, then the caller's values (None values are skipped). A compiled
        CPU decode pads every row's table to the step's longest (one group; eager uses up to
        4 width groups): there 64 sequences, not 256 (mixed: decode steps 3.3 s against
        11.8 s, docs/benchmarks.md)."""
        base: dict = {"max_num_batched_tokens": 8192} if device_type == "cuda" else {}
        if compiled and device_type != "cuda":
            base["max_num_seqs"] = CPU_POOL_ROWS
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)
