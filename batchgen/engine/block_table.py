"""The running sequences' block tables as rows of one int32 array, kept in step with the
scheduler's lists instead of rebuilt from them every step (vLLM v1's `BlockTable`).

The scheduler owns each sequence's `block_table`, a Python list that only grows while the
sequence runs (`+=` in place) and is replaced by a new list when the sequence is admitted again
after a preemption or finishes. So a row is brought up to date by copying the list's new tail
(usually nothing, one block in `block_size` steps); a list that is not the one the row was
copied from is copied whole. A step's decode tables are then one fancy-indexed slice of the
array, not a list of lists turned into a tensor (256 rows of 512 blocks: ~0.1 ms against 17 ms).

Rows are handed out per sequence and taken back when a finished sequence's row is needed.
numpy only: no torch, so it is tested with the scheduler alone.
"""

from __future__ import annotations

import numpy as np

from batchgen.engine.block_pool import NULL_BLOCK
from batchgen.engine.sequence import SeqState, SeqStatus


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = np.full((rows, width), NULL_BLOCK, dtype=np.int32)
        self._row: dict[SeqState, int] = {}
        self._copied: list[tuple[list[int] | None, int]] = [(None, 0)] * rows  # (list, length)
        self._free = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        """Rows held by sequences."""
        return len(self._row)

    def row(self, seq: SeqState) -> int:
        """seq's row, its table copied up to date."""
        r = self._row.get(seq)
        if r is None:
            r = self._row[seq] = self._take()
            self._copied[r] = (None, 0)
        src, done = self._copied[r]
        table = seq.block_table
        if src is not table:  # a new list (admitted again): the row is copied whole
            done = 0
        n = len(table)
        if n > done:
            if n > self.table.shape[1]:
                self._widen(n)
            self.table[r, done:n] = table[done:n]
        self._copied[r] = (table, n)
        return r

    def rows(self, seqs: list[SeqState]) -> np.ndarray:
        """(len(seqs),) int64 rows of seqs, each brought up to date."""
        return np.fromiter(map(self.row, seqs), dtype=np.int64, count=len(seqs))

    def release(self, seq: SeqState) -> None:
        """seq's row back to the free rows (a no-op for a sequence without one)."""
        r = self._row.pop(seq, None)
        if r is not None:
            self._copied[r] = (None, 0)
            self._free.append(r)

    def clear(self) -> None:
        for seq in list(self._row):
            self.release(seq)

    def _take(self) -> int:
        if not self._free:  # rows of finished sequences first, else more rows
            for seq in [s for s in self._row if s.status is SeqStatus.FINISHED]:
                self.release(seq)
        if not self._free:
            rows, width = self.table.shape
            self.table = np.concatenate([self.table, np.full_like(self.table, NULL_BLOCK)])
            self._copied += [(None, 0)] * rows
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _widen(self, n: int) -> None:
        rows, width = self.table.shape
        while width < n:
            width *= 2
        wider = np.full((rows, width), NULL_BLOCK, dtype=np.int32)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider
