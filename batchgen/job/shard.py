"""Shards: a deterministic 1/N of the input rows, chosen by a stable hash of each row's id.

Shard I/N holds the rows whose id hashes to I modulo N. The hash is BLAKE2b of a canonical
encoding of the id (not Python's hash(), which is salted per process), so every process on every
machine puts a row in the same shard: N shards cover every row exactly once, whatever order they
run in and however often each is restarted. Hashing ids rather than cutting row ranges means a
shard never needs to know how many rows the input has (JSON Lines inputs are not counted), and a
duplicate id always lands in one shard, where the usual uniqueness check catches it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_SPEC = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
_DIR = re.compile(r"shard-(\d{5})-of-(\d{5})")


class ShardError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Shard:
    index: int  # 0 <= index < count
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ShardError(f"shard count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ShardError(
                f"shard index must be in 0..{self.count - 1} for {self.count} shards, "
                f"got {self.index}"
            )

    @classmethod
    def parse(cls, value: str | Shard) -> Shard:
        """'I/N' (0-based I), e.g. '0/4' .. '3/4'."""
        if isinstance(value, Shard):
            return value
        m = _SPEC.fullmatch(str(value))
        if not m:
            raise ShardError(f"shard must look like I/N (e.g. 0/4), got {value!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    @classmethod
    def from_dirname(cls, name: str) -> Shard | None:
        m = _DIR.fullmatch(name)
        return cls(int(m.group(1)), int(m.group(2))) if m else None

    @property
    def dirname(self) -> str:
        """The shard's own output subdirectory: one writer per directory."""
        return f"shard-{self.index:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def mask(self, ids: Iterable[Any]) -> list[bool]:
        return [shard_of(i, self.count) == self.index for i in ids]


def shard_of(row_id: Any, count: int) -> int:
    """The shard (0..count-1) a row id belongs to; the same in every process."""
    if isinstance(row_id, bool):
        raise ShardError(f"cannot shard by a boolean id ({row_id!r}); ids must be unique")
    digest = hashlib.blake2b(id_bytes(row_id), digest_size=8).digest()
    return int.from_bytes(digest, "little") % count


def id_bytes(row_id: Any) -> bytes:
    """A canonical encoding of a row id, the same in every process (unlike hash())."""
    # Typed prefixes keep 1 and "1" apart; an int has one encoding whatever its Arrow width.
    if isinstance(row_id, int) and not isinstance(row_id, bool):
        return b"i" + str(row_id).encode()
    if isinstance(row_id, str):
        return b"s" + row_id.encode()
    if isinstance(row_id, bytes):
        return b"b" + row_id
    return b"j" + json.dumps(row_id, sort_keys=True, default=str).encode()


def shard_from_env(env: Mapping[str, str] = os.environ) -> Shard | None:
    """Shard SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT inside a Slurm array task, else None.

    The array must be numbered 0..N-1 (sbatch --array=0-N-1) for the ids to be shard indices.
    """
    task, count = env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_ARRAY_TASK_COUNT")
    if not task or not count:
        return None
    try:
        return Shard(int(task), int(count))
    except (ValueError, ShardError) as e:
        raise ShardError(
            f"cannot take the shard from SLURM_ARRAY_TASK_ID={task} / SLURM_ARRAY_TASK_COUNT="
            f"{count} ({e}); submit the array as "
            f"--array=0-{int(count) - 1 if count.isdigit() else 'N-1'} "
            "or pass --shard I/N"
        ) from None


def without_array_task(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """env less an enclosing Slurm array task's variables, for a process that gets its own shard."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_ARRAY_")}
