"""`batchgen run --workers N`: N processes over shards give the rows of one process."""

import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import success

from batchgen.data.layout import MERGED_FILE
from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.runner.run import run
from batchgen.scaleout.workers import plan_workers, run_workers

N_SLOW = 60
COMPARED = ["id", "prompt", "generated_text", "finish_reason", "prompt_tokens", "completion_tokens"]


def _data(path, n=30):
    prompts = [("the quick fox " * (1 + i % 6)) + str(i) for i in range(n)]
    pq.write_table(pa.table({"prompt": prompts}), path)
    return str(path)


def _sorted_rows(table: pa.Table) -> list[dict]:
    return sorted(table.select(COMPARED).to_pylist(), key=lambda r: r["id"])


def test_two_cpu_workers_equal_one_process(tmp_path, gpt2):
    base = dict(
        input=_data(tmp_path / "in.parquet"),
        model=str(gpt2),
        max_new_tokens=6,
        device="cpu",
        compile=False,
        quiet=True,
    )
    run(RunConfig(**base, output=str(tmp_path / "one")))
    summary = run_workers(RunConfig(**base, output=str(tmp_path / "two"), workers=2))
    assert [str(s.shard) for s in summary.shards] == ["0/2", "1/2"]
    assert all(s.rows > 0 for s in summary.shards) and summary.rows == 30
    one = pq.read_table(tmp_path / "one")
    two = pq.read_table(tmp_path / "two" / MERGED_FILE)
    assert _sorted_rows(two) == _sorted_rows(one)
    assert success(tmp_path / "two")


def test_plan_workers(monkeypatch):
    cfg = dict(input="i", output="o")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert plan_workers(RunConfig(**cfg, workers="auto")) == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "5"},
    ]
    assert len(plan_workers(RunConfig(**cfg, workers=1, device="cuda"))) == 1
    with pytest.raises(ConfigError, match="only 2 GPU"):
        plan_workers(RunConfig(**cfg, workers=3))
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        plan_workers(RunConfig(**cfg, workers=2, device="cuda:1"))
    cpu = plan_workers(RunConfig(**cfg, workers=2, device="cpu"))
    assert len(cpu) == 2 and all(e["CUDA_VISIBLE_DEVICES"] == "" for e in cpu)
    assert len(plan_workers(RunConfig(**cfg, workers="auto", device="cpu"))) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="no GPU"):
        plan_workers(RunConfig(**cfg, workers=2, device="cuda"))


@pytest.mark.slow
def test_sigterm_stops_the_workers_and_a_rerun_resumes(tmp_path, gpt2):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "batchgen.cli",
        "run",
        _data(tmp_path / "in.parquet", N_SLOW),
        "-m",
        str(gpt2),
        "-o",
        str(out),
        "--workers",
        "2",
        "--device",
        "cpu",
        "--no-compile",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--max-num-seqs",
        "2",
        "--rows-per-part",
        "2",
        "--flush-seconds",
        "0",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120

    def both_running() -> bool:  # each worker's shard begun (one may start late on a busy
        # machine) and a part written
        begun = len(list(out.glob("shard-*-of-00002"))) == 2
        return begun and bool(list(out.glob("shard-*/part-*.parquet")))

    while not both_running() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output
    shards = sorted(out.glob("shard-*-of-00002"))
    assert len(shards) == 2 and not any(success(d) for d in shards)
    saved = sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("shard-*/part-*.parquet"))
    assert 0 < saved < N_SLOW
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    ids = pq.read_table(out / MERGED_FILE).column("id").to_pylist()
    assert sorted(ids) == list(range(N_SLOW))
