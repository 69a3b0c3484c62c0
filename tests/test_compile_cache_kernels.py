"""The compile cache's built C++ kernels (engine/compile_kernels.py): kept beside the artifacts,
put back into a fresh local inductor folder before the compile reads it, so that a second
process on the CPU runs the C++ compiler not once (it built every kernel, the vector-ISA
probes and the 156 MB precompiled header again: 65-88% of the cold compile's time). What
another user can write is refused as the artifacts are; a bad file is a miss; a member that
would land outside its folder, or over a file that exists, is not written."""

import io
import os
import stat
import tarfile
import tempfile

import pytest
import torch
from helpers import rows_by_id, write_jsonl
from test_compile import _compiled_job

from batchgen.engine import compile_kernels
from batchgen.engine.compile_cache import CompileCache
from batchgen.errors import ConfigError


@pytest.fixture
def fresh_tmp(tmp_path, monkeypatch):
    """TMPDIR as on a new node: the local inductor folder and torch's header folder in it."""
    tmp = tmp_path / "node"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture
def cache(tmp_path, fresh_tmp) -> CompileCache:
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    return CompileCache.of(root, {"model": "tiny"}, torch.device("cpu"))


def _plant(cache: CompileCache) -> dict[str, bytes]:
    """Kernels and a header as a compile leaves them; returns {relative name: bytes}."""
    built = {"ab/cabc.so": b"kernel 1", "cd/cdef.so": b"kernel 2", "cd/cdef.cpp": b"source"}
    for rel, data in built.items():
        path = cache.inductor_dir() / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    compile_kernels.header_dir().mkdir(parents=True)
    (compile_kernels.header_dir() / "hx.h.gch").write_bytes(b"precompiled")
    return {k: v for k, v in built.items() if k.endswith(".so")} | {"hx.h.gch": b"precompiled"}


def _new_node(tmp_path, monkeypatch, name: str) -> None:
    (tmp_path / name).mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / name))


def _restored(cache: CompileCache) -> dict[str, bytes]:
    out = {}
    for folder in (cache.inductor_dir(), compile_kernels.header_dir()):
        for path in folder.rglob("*") if folder.exists() else ():
            if path.is_file():
                out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def test_kernels_round_trip_into_a_fresh_node(cache, tmp_path, monkeypatch):
    planted = _plant(cache)
    assert cache.save_kernels()
    _new_node(tmp_path, monkeypatch, "node2")
    assert cache.restore_kernels() == 3
    assert _restored(cache) == planted  # the built libraries and the header, not the sources
    mode = stat.S_IMODE((cache.inductor_dir() / "ab/cabc.so").stat().st_mode)
    assert not mode & 0o022
    assert cache.restore_kernels() == 0  # what exists is never written over


@pytest.mark.parametrize("who", ["key", "file"])
def test_kernels_others_can_write_are_refused(cache, who, tmp_path, monkeypatch):
    _plant(cache)
    assert cache.save_kernels()
    _new_node(tmp_path, monkeypatch, "node2")
    path = cache.dir if who == "key" else cache.kernels
    os.chmod(path, 0o777 if who == "key" else 0o666)
    with pytest.raises(ConfigError, match=r"writable by other users .* chmod go-w"):
        cache.restore_kernels()
    assert _restored(cache) == {}  # nothing restored


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_kernels_another_user_owns_are_refused(cache):
    _plant(cache)
    assert cache.save_kernels()
    os.chown(cache.kernels, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to another user"):
        cache.restore_kernels()


@pytest.mark.parametrize("data", [b"", b"\x1f\x8b\x08 not a tar", None])
def test_a_bad_kernels_file_is_a_miss(cache, data):
    """Empty, corrupt (gzip's CRC), or a FIFO: nothing restored, the compile builds them."""
    cache.dir.mkdir(parents=True)
    if data is None:
        os.mkfifo(cache.kernels)
    else:
        cache.kernels.write_bytes(data)
    assert cache.restore_kernels() is None


def test_members_outside_their_folder_are_not_written(cache, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("kernels/../../escape.so", "/abs.so", "kernels/x.py", "headers/a/b.h"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        link = tarfile.TarInfo("kernels/link.so")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    assert compile_kernels.restore(buf.getvalue(), cache.inductor_dir()) == 0
    assert _restored(cache) == {} and not (tmp_path / "escape.so").exists()


def test_a_header_folder_others_can_write_gets_no_header(cache):
    _plant(cache)
    assert cache.save_kernels()
    for path in compile_kernels.header_dir().iterdir():
        path.unlink()
    os.chmod(compile_kernels.header_dir(), 0o777)
    assert cache.restore_kernels() == 0  # the kernels exist; the header is not written
    assert not any(compile_kernels.header_dir().iterdir())


@pytest.mark.slow
def test_a_warm_process_runs_the_cpp_compiler_not_once(model, tmp_path, monkeypatch):
    """Every call of the C++ compiler that builds a file (kernels, ISA probes, the header),
    counted by a wrapper on $CXX: the cold process makes them, the warm one, on a fresh node
    with other pool and sequence sizes, none, and loads every graph."""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "bin" / "g++"  # (named g++: inductor picks its flags by the name)
    cxx.parent.mkdir()
    # (the header is preprocessed, -E, by every process: torch hashes it to find the .gch)
    cxx.write_text(
        f'#!/bin/sh\ncase " $* " in *" -E "*) ;; *" -o "*) echo "$*" >> {log};; esac\n'
        'exec g++ "$@"\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("PATH", "/usr/bin:/bin:" + os.environ["PATH"])  # the real g++ first
    rows = [{"prompt": f"row {i} " + "word " * (i * 5 % 13)} for i in range(10)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cache = tmp_path / "cache"
    cold = _compiled_job(data, tmp_path / "a", model, cache, tmp_path / "tmp-a", 2048, 8)
    built = len(log.read_text().splitlines()) if log.exists() else 0
    assert built >= 2 and len(list(cache.glob("*/kernels.tar.gz"))) == 1
    log.unlink()
    warm = _compiled_job(data, tmp_path / "b", model, cache, tmp_path / "tmp-b", 4096, 5)
    assert not log.exists(), log.read_text()[:2000]  # the compiler never built a file
    assert (cold["compile_cache"], warm["compile_cache"]) == ("miss", "hit")
    assert warm["graphs_compiled"] == 0 and warm["compiled_token_share"] == 1.0
    a, b = rows_by_id(tmp_path / "a"), rows_by_id(tmp_path / "b")
    assert {k: r["generated_text"] for k, r in a.items()} == {
        k: r["generated_text"] for k, r in b.items()
    }
