"""Compiled graphs kept across processes: one directory per key, shared by every job and task
that would compile the same graphs.

Why: a GPU job's compile costs its first minutes, and a 64-task Slurm array or a nightly job
paid it in every process. After the warm-up (engine/compiled_forward.py) the process's compile
artifacts, torch's portable ones (`torch.compiler.save_cache_artifacts`: inductor's FX graphs,
AOT autograd's, Triton's compiled kernels), are written to `<root>/<key>/artifacts.bin`; the
next process with the same key loads them into the inductor folder its compile reads (a
local one, `local_inductor_dir() / key`, on the CPU as on a GPU), and inductor compiles no
graph: torch's counters say so (`graphs_compiled` in the stats; "hit" means none compiled).
On the CPU the C++ kernels those graphs were built into travel too, in `kernels.tar.gz`
(engine/compile_kernels.py): without them a hit still ran the compiler for every kernel.

The key hashes everything that changes the graphs (`key_parts`, written beside as `key.json`):
the model's config, dtype, quantization, LoRA adapter, block size, attention path, TP size
and rank, batchgen's own source, the torch / Triton / CUDA versions and the device. The KV
pool's size and the engine's budgets are not in it: the graph never sees them.

The artifacts are pickles and shared objects: loading one runs its code. So a root, key folder
or file owned by another user (root excepted) or writable by others is refused with one line
naming the fix (exit 2), and the local inductor folder is made private (0700, created
atomically, its owner checked). An artifacts file that is not a regular file (a FIFO, a link
to /dev/zero), empty, too large or unreadable by torch is a miss, replaced after the compile.
A read-only root loads and never writes; a full one costs the next job a compile, no more.
Writes are atomic (a temp file renamed over the old), so 64 tasks that start at once and all
miss each write a whole file, and none reads a half-written one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import platform
import stat
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from batchgen.engine import compile_kernels
from batchgen.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "BATCHGEN_COMPILE_CACHE"  # the cache's root, as --compile-cache sets it
OFF = "off"  # as the root: no compile cache
# Larger than any artifacts file a model's graphs make (a 0.5B model's: ~10 MB): past it the
# file is not read (a link to /dev/zero would fill memory).
MAX_ARTIFACT_BYTES = 2**31
_TRUSTED_OWNERS = (0,)  # besides the user: root, who can run anything as anyone anyway
_PACKAGE = Path(__file__).resolve().parents[1]


def default_root() -> Path:
    """$BATCHGEN_COMPILE_CACHE, else ~/.cache/batchgen/compile ($XDG_CACHE_HOME). ("off" is
    the caller's to read: job/model_spec.resolve_compile_cache.)"""
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

    @property
    def kernels(self) -> Path:
        return self.dir / "kernels.tar.gz"  # the built C++ kernels (engine/compile_kernels.py)

    def load(self) -> str:
        """Load the key's artifacts into this process's compile caches (inside the inductor
        folder the compile reads): "loaded", "missing", or "bad" (not a regular file, empty,
        too large or unreadable by torch: a miss whose file the next save replaces). Raises
        ConfigError for a root, key folder or file another user owns or can write."""
        self._check_folders()
        data = _read_cache_file(self.artifacts)
        if data is None:
            return "missing" if not os.path.lexists(self.artifacts) else "bad"
        try:
            loaded = torch.compiler.load_cache_artifacts(data)
        except Exception as e:  # corrupt, or a torch that cannot read them: compile
            log.warning("compile cache %s not loaded (%s): compiling", self.artifacts, e)
            return "bad"
        return "loaded" if loaded is not None else "bad"

    def restore_kernels(self) -> int | None:
        """Put the key's built C++ kernels back into its inductor folder before the compile
        reads it: the files written, None for a missing or bad file (a miss: the compile
        builds them). Checked as the artifacts are (load)."""
        self._check_folders()
        data = _read_cache_file(self.kernels)
        return None if data is None else compile_kernels.restore(data, self.inductor_dir())

    def _check_folders(self) -> None:
        for path in (self.root, self.dir):
            if path.exists():
                check_private(path, "compile cache folder")

    def save(self) -> bool:
        """Write this process's compile artifacts under the key, over any earlier file (this
        process compiled: the file did not serve it). True if written; a read-only or full
        root logs one warning and the job goes on."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        key = json.dumps(self.parts, indent=1, default=str).encode()
        return self._write(self.dir / "key.json", key) and self._write(self.artifacts, saved[0])

    def save_kernels(self) -> bool:
        """Keep the C++ kernels built in this key's inductor folder, and the precompiled
        headers they were built with, beside the artifacts (none on a GPU: False)."""
        data = compile_kernels.pack(self.inductor_dir())
        return data is not None and self._write(self.kernels, data)

    def _write(self, path: Path, data: bytes) -> bool:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            check_private(self.dir, "compile cache folder")
            _publish(path, data)
        except OSError as e:
            log.warning("compile cache not written to %s: %s", self.dir, e)
            return False
        return True

    def inductor_dir(self) -> Path:
        """Where inductor keeps its own cache while this key's graphs compile and load: a
        local folder per key, on the CPU as on a GPU (inductor's file locks on a shared
        filesystem are a risk; what a second process needs travels in the artifacts, which
        load into this folder)."""
        return local_inductor_dir() / self.key


def local_inductor_dir() -> Path:
    """A local folder for inductor's cache, one per batchgen source (inductor's FX graph cache
    does not key on a custom op's fake function: a graph cached by another batchgen version
    failed a stride check once the ops had changed), under a private folder of this user's."""
    return private_dir(Path(tempfile.gettempdir()) / f"batchgen-inductor-{os.getuid()}") / (
        source_hash()
    )


def private_dir(path: Path) -> Path:
    """path as a folder only this user can enter: made with mode 0700 in one step (mkdir
    fails if another made it first), or, if it exists, checked to be a real folder of this
    user's that no one else could write (one an older batchgen made 0755 is closed to 0700)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ConfigError(
                f"{path} is not a private folder of this user's (another user may have made "
                "it, and compiled code loads from it): remove it, or set TMPDIR to a folder "
                "of your own"
            ) from None
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)
    return path


def check_private(path: Path, what: str) -> None:
    """Refuse path when another user (root excepted) owns it or others can write it: its
    compiled artifacts run as code when loaded."""
    st = os.stat(path)
    fix = f"use a folder of your own (--compile-cache DIR) or --compile-cache {OFF}"
    if st.st_uid != os.getuid() and st.st_uid not in _TRUSTED_OWNERS:
        raise ConfigError(f"{what} {path} belongs to another user (uid {st.st_uid}): {fix}")
    if st.st_mode & 0o022:
        mode = oct(stat.S_IMODE(st.st_mode))
        raise ConfigError(
            f"{what} {path} is writable by other users (mode {mode}): chmod go-w {path}, or {fix}"
        )


def _read_cache_file(path: Path) -> bytes | None:
    """The artifacts file's bytes; None when it is missing or not worth reading (a link, not
    a regular file, empty, too large). Opened without following a link and without blocking
    (a FIFO would hang the job), then checked on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink (ELOOP), a folder, no permission
        if e.errno != errno.ELOOP:
            log.warning("compile cache %s not read (%s): compiling", path, e)
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= MAX_ARTIFACT_BYTES:
            return None
        check_private(path, "compile cache file")
        return f.read(MAX_ARTIFACT_BYTES)


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


def _publish(path: Path, data: bytes) -> None:
    """Write data to path atomically: a temp file of this process's, renamed over path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
