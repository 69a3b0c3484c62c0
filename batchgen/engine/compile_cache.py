"""Compiled graphs kept across processes: one directory per key, shared by every job and task
that would compile the same graphs.

Why: a GPU job's compile costs its first minutes, and a 64-task Slurm array or a nightly job
paid it in every process. After the warm-up (engine/model_runner.py) the process's compile
artifacts, torch's portable ones (`torch.compiler.save_cache_artifacts`: inductor's FX graphs,
AOT autograd's, Triton's compiled kernels), are written to `<root>/<key>/artifacts.bin`; the
next process with the same key loads them before compiling, and dynamo's trace is all that is
left. On the CPU inductor's C++ kernels are not among those artifacts, so the warm-up also
points inductor's own cache at `<root>/<key>/inductor` (its compiled .so files stay there); on
a GPU, and without a compile cache, at a local folder per batchgen source
(`local_inductor_dir`): inductor's FX graph cache does not key on a custom op's fake function,
and a graph another batchgen version cached failed a stride check once the ops had changed.

The key hashes everything that changes the graphs (`key_parts`, written beside as `key.json`):
the model's config, dtype, quantization, LoRA adapter, block size, attention path, TP size
and rank, batchgen's own source, the torch / Triton / CUDA versions and the device. Writes are
atomic and the first writer wins (a hard link of a finished temp file), so 64 tasks that start
at once and all miss each compile once, and none reads a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "BATCHGEN_COMPILE_CACHE"  # the cache's root, as --compile-cache sets it
_PACKAGE = Path(__file__).resolve().parents[1]


def default_root() -> Path:
    """$BATCHGEN_COMPILE_CACHE, else ~/.cache/batchgen/compile ($XDG_CACHE_HOME)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchgen" / "compile"


@cache
def source_hash() -> str:
    """batchgen's own source: a change to any module may change a graph."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """The software and hardware a compiled graph is only good for."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "machine": platform.machine(),
        "batchgen_source": source_hash(),
    }
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    return env


def key_of(parts: Mapping[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class CompileCache:
    root: Path
    parts: Mapping[str, Any]  # what the key hashes

    @classmethod
    def of(cls, root: Path, parts: Mapping[str, Any], device: torch.device) -> CompileCache:
        return cls(Path(root), {**parts, **environment(device)})

    @property
    def key(self) -> str:
        return key_of(self.parts)

    @property
    def dir(self) -> Path:
        return self.root / self.key

    @property
    def artifacts(self) -> Path:
        return self.dir / "artifacts.bin"

    def load(self) -> bool:
        """Load the key's artifacts into this process's compile caches: True on a hit."""
        try:
            data = self.artifacts.read_bytes()
        except OSError:
            return False
        try:
            torch.compiler.load_cache_artifacts(data)
        except Exception as e:  # a torch that cannot read them: compile as on a miss
            log.warning("compile cache %s not loaded (%s): compiling", self.artifacts, e)
            return False
        return True

    def save(self) -> bool:
        """Write this process's compile artifacts under the key, unless another process did
        first. True if this one wrote them."""
        if self.artifacts.exists():
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _publish(self.dir / "key.json", json.dumps(self.parts, indent=1, default=str).encode())
            return _publish(self.artifacts, saved[0])
        except OSError as e:  # a full or read-only cache costs the next job a compile, no more
            log.warning("compile cache not written to %s: %s", self.dir, e)
            return False

    def inductor_dir(self) -> Path:
        """Where inductor keeps its own cache while this key's graphs compile and load: a
        local folder per key, on the CPU as on a GPU (inductor's file locks on a shared
        filesystem are a risk; what a second process needs travels in the artifacts, which
        load into this folder)."""
        return local_inductor_dir() / self.key


def local_inductor_dir() -> Path:
    """A local folder for inductor's cache, one per batchgen source: inductor's FX graph cache
    does not key on a custom op's fake (meta) function, so a graph cached by another batchgen
    version failed a stride check at run time when the ops' fakes had changed."""
    return Path(tempfile.gettempdir()) / f"batchgen-inductor-{os.getuid()}" / source_hash()


@contextlib.contextmanager
def inductor_scope(path: Path) -> Iterator[None]:
    """TORCHINDUCTOR_CACHE_DIR at path for the block (compiles in it use it), then back."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _publish(path: Path, data: bytes) -> bool:
    """Write data to path atomically, unless path exists: the first writer wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
