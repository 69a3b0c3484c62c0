"""How many blocks the KV pool holds, and the order it is made in, once, at the first request.

Three sources, the first that applies wins:
- --kv-cache-tokens: that many tokens, rounded up to blocks;
- a GPU's memory (vLLM's order): the warm-up runs on a pool of two blocks, then the pool takes
  what it left of gpu_memory_utilization x the device's memory (ModelRunner.kv_budget_bytes);
- the job (the CPU's): its longest row (prompt + max_new_tokens) times max_num_seqs up to
  CPU_POOL_ROWS (engine/config.py), so memory follows the work instead of a fixed size. The
  longest row is the whole job's where the caller knows it (`reserve`), else the first
  read-ahead's. Such a pool is checked against free memory before it is made, and the
  scheduler reserves full rows in it (`SizedPool.holds_full_rows`).
All three are capped at the blocks the attention kernel can address (`max_pool_blocks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen.engine.config import EngineConfig
from batchgen.engine.sequence import KVPool, Request
from batchgen.model.memory import check_allocation

if TYPE_CHECKING:
    from batchgen.engine.model_runner import ModelRunner
    from batchgen.engine.step_inputs import WarmUp


def pool_blocks(
    cfg: EngineConfig,
    longest_row: int,
    budget_bytes: int | None,
    bytes_per_block: int,
    max_blocks: int | None = None,
) -> int:
    """Blocks in the KV pool, the scratch block included: from cfg.kv_cache_tokens, else
    budget_bytes (a GPU's, after the warm-up), else the job's longest row. max_blocks: the most
    the attention kernel can address, a bound on all three."""
    bs = cfg.block_size
    if cfg.kv_cache_tokens is not None:
        blocks = -(-cfg.kv_cache_tokens // bs)
    elif budget_bytes is not None:
        blocks = max(2, budget_bytes // bytes_per_block)
    else:
        blocks = 1 + cfg.pool_rows * -(-longest_row // bs)
    return blocks if max_blocks is None else min(blocks, max_blocks)


@dataclass(slots=True, frozen=True)
class SizedPool:
    """The KV pool as allocated and warmed up: what the scheduler and the stats need of it."""

    kv_pool: KVPool
    holds_full_rows: bool  # sized from the job: admission reserves each row's full length
    warm: WarmUp


@dataclass(slots=True)
class PoolSizer:
    """Sizes, allocates and warms up the runner's KV pool (the module's docstring)."""

    config: EngineConfig
    job_longest: int = 0  # the caller's whole job's longest row (CPU sizing), if known

    def reserve(self, longest: int) -> None:
        """Size a pool sized from the job for rows of `longest` tokens, not only the first
        read-ahead's; before the first run."""
        self.job_longest = max(self.job_longest, longest)

    def longest_row(self, first: Iterable[Request], max_positions: int) -> int:
        """The row a pool sized from the job holds pool_rows of: the job's longest, or the
        first requests', within the model's positions."""
        longest = max((r.longest_tokens for r in first), default=self.job_longest or 1)
        return min(max(longest, self.job_longest), max_positions)

    def start(self, runner: ModelRunner, first: Iterable[Request]) -> SizedPool:
        """Size and allocate the pool on runner, and warm up, in the order its source needs."""
        cfg = self.config
        longest = self.longest_row(first, runner.max_positions)
        block_bytes = runner.kv_bytes_per_block()
        measured = runner.measures_memory and cfg.kv_cache_tokens is None
        budget = None
        if measured:
            runner.allocate(2)  # the scratch block and one: what the warm-up writes
            warm = runner.warm_up(cfg.max_num_seqs, cfg.max_num_batched_tokens)
            budget = runner.kv_budget_bytes(cfg.gpu_memory_utilization)
        blocks = pool_blocks(cfg, longest, budget, block_bytes, runner.max_pool_blocks())
        from_job = not measured and cfg.kv_cache_tokens is None
        if from_job:
            ranks = runner.host_ranks  # tensor-parallel ranks sharing this memory
            check_allocation(
                blocks * block_bytes * ranks,
                f"the KV cache sized from the job ({longest} tokens, its longest row, x "
                f"{cfg.pool_rows} rows" + (f", x {ranks} ranks' shares" if ranks > 1 else "") + ")",
                "--max-new-tokens or --max-num-seqs, or set --kv-cache-tokens",
                runner.device,
            )
        runner.allocate(blocks)
        if measured:
            runner.rewarm_attention(cfg.max_num_seqs)
        else:
            warm = runner.warm_up(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        kv_pool = KVPool(blocks, cfg.block_size, blocks * block_bytes)
        return SizedPool(kv_pool, from_job, warm)
