"""After a stop signal or a fatal error the process exits within seconds, even while its main
thread is stuck in a long step (issue 22). Real subprocesses, whose model step is replaced by
one that never returns (a blocking call, as a huge allocation or prefill is)."""

import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, prompts, write_parquet

# Runs `batchgen run ARGS` with the engine's step replaced: it marks a file, then blocks
# (`hang`), or raises MemoryError and the final flush then blocks (`fatal`).
_SCRIPT = """
import sys, time
from pathlib import Path
import batchgen.engine.model_runner as mr
import batchgen.data.records as records
mode, marker = sys.argv[1], Path(sys.argv[2])
def step(self, plan, bitmask=None):
    marker.write_text("busy")
    if mode == "fatal":
        def flush(self, final=False):
            time.sleep(600)
        records.PartBuffer.flush = flush
        raise MemoryError("a fake allocation failure")
    time.sleep(600)
mr.ModelRunner.execute = step
from batchgen.cli.main import main
sys.argv = ["batchgen", "run", *sys.argv[3:]]
main()
"""


def _start(tmp_path, model, mode: str) -> tuple[subprocess.Popen, object]:
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    marker = tmp_path / "busy"
    args = [str(src), "-o", str(tmp_path / "out"), "--model", str(model)]
    args += ["--device", "cpu", "--no-compile", "--kv-cache-tokens", "512", "--quiet"]
    cmd = [sys.executable, "-c", _SCRIPT, mode, str(marker), *args]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the job never reached its first step"
        time.sleep(0.1)
    return p, marker


def _wait(p: subprocess.Popen, bound: float) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail(f"still running {bound} s later")
    return p.returncode, err.decode()


@pytest.mark.slow  # a start-up and the 8 s grace
def test_sigterm_during_a_step_that_never_returns_exits_143(tmp_path, model):
    p, _ = _start(tmp_path, model, "hang")
    p.send_signal(signal.SIGTERM)
    code, err = _wait(p, 15)
    assert code == 143, err
    assert "after SIGTERM" in err


@pytest.mark.slow  # a start-up and the 10 s grace
def test_a_fatal_error_whose_cleanup_hangs_still_exits(tmp_path, model):
    p, _ = _start(tmp_path, model, "fatal")
    code, err = _wait(p, 30)  # the cleanup's 10 s, and start-up's slack
    assert code == 1, err
    assert "Timeout" in err  # faulthandler's report: where each thread was
