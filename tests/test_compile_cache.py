"""The compile cache's files, without compiling: its artifacts are pickles and shared objects
(loading one runs its code), so what others can write is refused; files that are not good
artifacts are misses that the next save replaces; a read-only or full root, and `off`, never
end a job (engine/compile_cache.py). The caches that really load are test_compile.py's."""

import errno
import logging
import os
import threading

import pytest
import torch

from batchgen.engine import compile_cache
from batchgen.engine.compile_cache import CompileCache, private_dir
from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.scaleout.slurm import _compile_cache_root


@pytest.fixture
def cache(tmp_path, monkeypatch) -> CompileCache:
    """A cache whose saves write b"NEW" (as torch's save_cache_artifacts would its bytes)."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"NEW", None))
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    c = CompileCache.of(root, {"model": "tiny"}, torch.device("cpu"))
    c.dir.mkdir(mode=0o755)
    return c


@pytest.mark.parametrize("where", ["root", "key", "file"])
def test_what_others_can_write_is_refused_in_one_line(cache, where):
    cache.artifacts.write_bytes(b"x")
    path = {"root": cache.root, "key": cache.dir, "file": cache.artifacts}[where]
    os.chmod(path, 0o777 if where != "file" else 0o666)
    with pytest.raises(ConfigError, match=r"writable by other users .* chmod go-w") as e:
        cache.load()
    assert "\n" not in str(e.value) and str(path) in str(e.value)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_a_root_another_user_owns_is_refused(cache):
    os.chown(cache.root, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to another user .* --compile-cache off"):
        cache.load()


def _fifo(path):
    os.mkfifo(path)


def _dev_zero(path):
    os.symlink("/dev/zero", path)


def _empty(path):
    path.write_bytes(b"")


def _corrupt(path):
    path.write_bytes(b"\x80\x04not torch's artifacts" * 8)


@pytest.mark.parametrize("plant", [_fifo, _dev_zero, _empty, _corrupt])
def test_a_bad_artifacts_file_is_a_miss_and_replaced(cache, plant):
    """A FIFO hung every compiled job at its read, /dev/zero ran out of memory, and an empty
    or corrupt file was reported a hit and never replaced."""
    plant(cache.artifacts)
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(cache.load()), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert result == ["bad"]  # at once, not hung
    assert cache.save()
    assert cache.artifacts.is_file() and not cache.artifacts.is_symlink()
    assert cache.artifacts.read_bytes() == b"NEW"


def test_a_missing_file_is_a_miss(cache):
    assert cache.load() == "missing"


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_a_read_only_or_full_root_costs_a_warning(cache, monkeypatch, caplog, err):
    """(Root ignores a folder's mode, so the file system's refusal is what is simulated.)"""

    def refuse(path, data):
        raise OSError(err, os.strerror(err), str(path))

    monkeypatch.setattr(compile_cache, "_publish", refuse)
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.compile_cache"):
        assert cache.save() is False
    assert "compile cache not written" in caplog.text
    assert cache.load() == "missing"  # load-only: nothing to load, nothing raised


def test_the_local_inductor_folder_is_private(tmp_path):
    made = private_dir(tmp_path / "mine")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert private_dir(made) == made  # one of this user's, private: used again
    (tmp_path / "older").mkdir(mode=0o755)  # an older batchgen's: closed, not refused
    assert (private_dir(tmp_path / "older").stat().st_mode & 0o777) == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    os.symlink(tmp_path / "mine", tmp_path / "link")
    for planted in ("open", "link"):  # another user could have made either first
        with pytest.raises(ConfigError, match="not a private folder .* set TMPDIR"):
            private_dir(tmp_path / planted)


def test_slurm_keeps_the_cache_off(monkeypatch, tmp_path):
    """BATCHGEN_COMPILE_CACHE=off (or --compile-cache off) exported a folder named `off`."""
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert _compile_cache_root(RunConfig(input="in", output="out")) == "off"
    cfg = RunConfig(input="in", output="out", compile_cache="off")
    monkeypatch.delenv(compile_cache.ENV)
    assert _compile_cache_root(cfg) == "off"
    mine = RunConfig(input="in", output="out", compile_cache=str(tmp_path))
    assert _compile_cache_root(mine) == str(tmp_path.resolve())
