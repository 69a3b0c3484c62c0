"""Reading a checkpoint directory's weight files: which files (a sharded index, single
safetensors files, or trusted pickles), each tensor as a slice handle so a tensor-parallel rank
reads only its part, a failed read as one line, and the dtypes pre-quantized weights are
stored in. model/checkpoint/loader.py puts what these return into the model.

A slice handle reads through the file's memory map, and every page it touches stays in the
process's resident memory while the file is open: right for a tensor that is kept as it is
(its pages are the weight), twice the bytes for one that is converted at once (INT4's packed
words). Those are read whole into fresh memory instead (`WholeReads`), with plain reads."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.parallel.sharding import Copy


def checkpoint_files(path: Path, allow_pickle: bool) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = sorted(path.glob("*.safetensors"))
    if single:
        return single
    pickles = sorted(path.glob("pytorch_model*.bin"))
    if pickles and allow_pickle:
        return pickles
    if pickles:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({pickles[0].name}); pickle files can run code "
            "when loaded. Convert to safetensors, or pass --allow-pickle if you trust the file."
        )
    raise ModelLoadError(f"no *.safetensors weights in {path}")


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Any, Path]]:
    """(name, tensor, file) of every checkpoint tensor; a safetensors tensor comes as a slice
    handle, so a rank reads only the bytes of its part (`take`)."""
    from safetensors import safe_open

    for f in files:
        with reading(f):
            if f.suffix == ".bin":
                tensors = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                for name, t in tensors.items():
                    yield name, t, f
                continue
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, sf.get_slice(name), f


@contextlib.contextmanager
def reading(f: Path) -> Iterator[None]:
    """A failed read of weights file f as a one-line ModelLoadError."""
    from safetensors import SafetensorError

    try:
        yield
    except pickle.UnpicklingError as e:
        # weights_only=True refuses objects other than tensors, which is what allows it;
        # torch's message goes on for a page, its first sentence says what happened.
        first = str(e).split(".")[0]
        raise ModelLoadError(
            f"cannot read weights file {f}: it holds more than tensors, or is not a PyTorch "
            f"checkpoint ({first}); convert a trusted copy to safetensors"
        ) from None
    except (OSError, RuntimeError, ValueError, EOFError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read weights file {f}: {e}") from e


def take(tensor: Any, copy: Copy, transposed: bool) -> torch.Tensor:
    """copy's slice of a checkpoint tensor (a safetensors slice handle or a tensor)."""
    if copy.src is None:
        t = tensor[:]
    else:
        shape = tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape
        index = [slice(None)] * len(shape)
        index[1 - copy.dim if transposed else copy.dim] = copy.src
        t = tensor[tuple(index)]
    return t.t().contiguous() if transposed else t


_STORED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8}


def stored_dtype(tensor: Any) -> torch.dtype | None:
    """A checkpoint tensor's dtype if it is one a pre-quantized weight is stored in."""
    if hasattr(tensor, "get_dtype"):
        return _STORED_DTYPES.get(tensor.get_dtype())
    return tensor.dtype if tensor.dtype in _STORED_DTYPES.values() else None


def shape_of(tensor: Any) -> list[int]:
    return tensor.get_shape() if hasattr(tensor, "get_shape") else list(tensor.shape)


_TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
}


# safetensors' own bound on a header (its Rust reader refuses more): a larger length is garbage
MAX_HEADER_BYTES = 100_000_000


def safetensors_layout(file: Path) -> tuple[int, dict[str, dict]]:
    """Where a safetensors file's data starts, and its JSON header: name -> {"dtype",
    "shape", "data_offsets"} (offsets from that start); no data read. A file that is not
    safetensors is one line (ModelLoadError)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(os.fstat(f.fileno()).st_size - 8, MAX_HEADER_BYTES):  # not safetensors
                raise ValueError(f"a header of {n} bytes does not fit the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"cannot read weights file {file}: {e}") from None
    header.pop("__metadata__", None)
    return 8 + n, header


def safetensors_header(file: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", ...} from a safetensors file's JSON header, no data read."""
    return safetensors_layout(file)[1]


class WholeReads:
    """Whole safetensors tensors read with plain file reads into fresh memory, not through the
    memory map: nothing of the file stays resident after the caller drops the tensor. Each
    file's header is read once (a safetensors file: an 8-byte little-endian header length,
    the JSON header of each tensor's dtype, shape and byte offsets, then the data)."""

    def __init__(self) -> None:
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def _header(self, f: Path) -> tuple[int, dict[str, Any]]:
        if f not in self._headers:
            self._headers[f] = safetensors_layout(f)
        return self._headers[f]

    def read(self, f: Path, name: str, handle: Any) -> torch.Tensor:
        """Tensor name of file f; handle: its slice handle (or tensor), read as it is where
        f is not a safetensors file or the dtype is not one named here."""
        if f.suffix != ".safetensors":
            return handle[...]
        start, header = self._header(f)
        entry = header[name]
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            return handle[...]
        begin, end = entry["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(f, "rb") as fh:
            fh.seek(start + begin)
            if fh.readinto(buf.numpy()) != end - begin:
                raise ModelLoadError(f"weights file {f} ends inside its tensor {name}")
        return buf.view(dtype).reshape(entry["shape"])
