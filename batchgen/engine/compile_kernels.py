"""The C++ kernels of a compile, kept beside its artifacts (engine/compile_cache.py).

Why: on the CPU inductor's graphs are C++ kernels that each process builds with the system's
compiler into its local inductor folder, and torch's portable artifacts hold their source, not
the built libraries. A second process on a fresh node loaded every graph from the artifacts
(0 compiled) and still spent most of the cold compile's time in the compiler: llama-55m, 15
kernels, the vector-ISA probes (also built libraries) and the precompiled header of torch's
C++ prelude (`cpp_prefix.h`, a 156 MB `.gch` built in 11 s, rebuilt even when every kernel
exists). Each is looked up by a hash of its source and compiler command, so a file put back
at its path is used as is; one that does not match is never looked up.

`pack` gathers, after the compile, the `.so` files of the local inductor folder and the
precompiled headers of torch's header folder into one gzip'd tar (`kernels.tar.gz`: ~27 MB
for llama-55m, almost all of it the header; gzip's CRC makes a corrupt file a read error).
`restore` puts them back before the compile reads them: regular files only, under their own
folder (no absolute name, no `..`, no link), only `.so`, `.h` and `.h.gch`, never over a file
that exists, each written under a temporary name and renamed (other processes on the node may
be loading the same folder). A file that cannot be read is a miss: nothing or part restored,
and the compile builds what is missing. The tar itself is checked as the artifacts are (owner,
mode, a regular file) by compile_cache before its bytes reach here.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import uuid
import zlib
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

KERNELS, HEADERS = "kernels", "headers"  # the tar's two folders
MAX_RESTORED_BYTES = 2**31  # what a tar may unpack to, all members together
_SUFFIXES = {KERNELS: (".so",), HEADERS: (".h", ".h.gch")}


def header_dir() -> Path:
    """Where inductor keeps its precompiled headers: outside its cache folder, in the default
    one (torch/_inductor/codecache.py's _HEADER_DIR), so the key's folder does not hold them.
    Imported here, not at the top: torch._inductor brings all of torch._dynamo, 1.6 CPU-s of
    an eager job's start-up on this CPU."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()) / "precompiled_headers"


def pack(inductor_dir: Path) -> bytes | None:
    """The built kernels under inductor_dir and the precompiled headers, as a gzip'd tar; None
    when the folder has no `.so` (a GPU's kernels are Triton's, in the artifacts)."""
    kernels = _files(inductor_dir, _SUFFIXES[KERNELS], recurse=True)
    if not kernels:
        return None
    members = [(f"{KERNELS}/{p.relative_to(inductor_dir)}", p) for p in kernels]
    headers = _files(header_dir(), _SUFFIXES[HEADERS], recurse=False)
    members += [(f"{HEADERS}/{p.name}", p) for p in headers]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for name, path in members:
            tar.add(path, arcname=name, recursive=False)
    return buf.getvalue()


def _files(folder: Path, suffixes: tuple[str, ...], recurse: bool) -> list[Path]:
    if not folder.is_dir():
        return []
    paths = folder.rglob("*") if recurse else folder.glob("*")
    return sorted(p for p in paths if p.name.endswith(suffixes) and _regular(p))


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def restore(data: bytes, inductor_dir: Path) -> int | None:
    """Put the tar's kernels under inductor_dir and its headers in header_dir(): the number
    of files written (0: every one was there already), None when the tar cannot be read."""
    targets = {KERNELS: inductor_dir, HEADERS: header_dir()}
    written, total = 0, 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                dest = _destination(member, targets)
                total += member.size
                if dest is None or total > MAX_RESTORED_BYTES or os.path.lexists(dest):
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                _write(dest, src.read(), 0o755 if dest.suffix == ".so" else 0o644)
                written += 1
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        log.warning("compile cache kernels not restored (%s): building them", e)
        return None
    return written


def _destination(member: tarfile.TarInfo, targets: dict[str, Path]) -> Path | None:
    """Where a member goes, or None for one that is not ours to write: not a regular file, an
    absolute name or one with `..`, another folder or suffix, or a header folder that is not
    this user's (torch's default folder, which another user may have made)."""
    parts = PurePosixPath(member.name).parts
    if not member.isreg() or len(parts) < 2 or parts[0] not in targets:
        return None
    if any(p in ("", ".", "..") for p in parts) or not parts[-1].endswith(_SUFFIXES[parts[0]]):
        return None
    if parts[0] == HEADERS and len(parts) != 2:
        return None
    root = targets[parts[0]]
    if parts[0] == HEADERS:
        root.mkdir(parents=True, exist_ok=True)
        st = os.lstat(root)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
    return root.joinpath(*parts[1:])


def _write(dest: Path, data: bytes, mode: int) -> None:
    """data at dest, written under a temporary name and renamed: whole or not there."""
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
