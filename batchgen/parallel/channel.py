"""Rank 0's commands to the other ranks: pickled messages, each prefixed with its length,
over one pipe per rank (the rank's stdin). A pipe costs tens of microseconds a message, and
breaks loudly when either end dies: a write to a dead rank raises BrokenPipeError, a read
after rank 0 died ends the rank with EOFError."""

from __future__ import annotations

import pickle
from typing import IO, Any

_LEN = 8  # bytes of the length prefix


def pack(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(_LEN, "little") + data


def write(pipe: IO[bytes], packed: bytes) -> None:
    pipe.write(packed)
    pipe.flush()


def read(pipe: IO[bytes]) -> Any:
    """The next message; EOFError when the writer is gone."""
    n = int.from_bytes(_exactly(pipe, _LEN), "little")
    return pickle.loads(_exactly(pipe, n))


def _exactly(pipe: IO[bytes], n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = pipe.read(n - got)
        if not chunk:
            raise EOFError("rank 0 closed the command pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
