"""Threads on a quiet and a busy machine: `batchgen run` under several thread and OpenMP wait
settings, each quiet and beside a busy loop pinned to one CPU, whole processes, round-robin.

    python scripts/bench_threads.py --workload mixed --rounds 2 \\
        --ov-python /work/ovenv/bin/python --out out/threads.json

A mode is NAME=ENV;FLAGS: environment variables (K=V, comma-separated) and extra `batchgen run`
flags. The defaults compare what batchgen does unasked (OpenMP's passive waits, the thread
governor: job/threads.py) with spinning waits under the governor, two fixed threads and one
thread; `--ov-python` adds OpenVINO GenAI (scripts/ov_baseline.py, 2048-token steps) and
`--hf sorted:16` a transformers baseline (scripts/hf_baseline.py). Each
round runs every mode quiet, then every mode with `taskset -c CPU python -c "while True:
pass"` running (CPU: --busy-cpu). Printed: each mode's median wall seconds quiet and busy and
its slowdown (busy / quiet); every run's seconds are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import bench_models  # noqa: E402

MODES = (
    "default=;",
    "spin+governor=OMP_WAIT_POLICY=ACTIVE;",
    "passive, 2 fixed=;--threads 2",
    "1 thread=;--threads 1",
)


def parse_mode(text: str) -> tuple[str, dict[str, str], list[str]]:
    name, _, rest = text.partition("=")
    env_text, _, flags = rest.partition(";")
    env = dict(kv.split("=", 1) for kv in env_text.split(",") if kv)
    return name, env, flags.split()


@contextmanager
def busy_loop(cpu: int | None):
    """A process spinning on one CPU for the duration (none with cpu None)."""
    if cpu is None:
        yield
        return
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield
    finally:
        p.kill()
        p.wait()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="mixed")
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mode", action="append", default=None, help="NAME=K=V,K=V;FLAGS (repeat)")
    p.add_argument("--busy-cpu", type=int, default=min(os.sched_getaffinity(0)))
    p.add_argument("--ov-python", default=None, help="OpenVINO GenAI's interpreter: add it")
    p.add_argument("--hf", default=None, help="add a transformers baseline, MODE:BATCH (sorted:16)")
    p.add_argument("--workdir", type=Path, default=bench.ROOT / "out" / "bench-threads")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    a.device, a.dtype, a.threads, a.batchgen_args = "cpu", "float32", None, ""
    a.workdir.mkdir(parents=True, exist_ok=True)
    model = bench_models.cached(a.model, a.dtype, a.device)
    data, _ = bench.write_workload(a.workload, a.rows, a.model, a.workdir)
    modes = [parse_mode(m) for m in (a.mode or MODES)]
    if a.ov_python:
        subprocess.check_call(bench.ov_cmd(a, model, None, None, 0))  # export once, untimed
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for cond, cpu in (("quiet", None), ("busy", a.busy_cpu)):
            with busy_loop(cpu):
                for name, env, flags in modes:
                    a.batchgen_args = " ".join(flags)
                    out = a.workdir / f"out-{r}"
                    cmd = bench.batchgen_cmd(a, model, data, out)
                    log = a.workdir / f"{name.replace(' ', '_')}-{cond}-{r}.log"
                    times.setdefault(name, {}).setdefault(cond, []).append(
                        bench.timed(cmd, log, env)["wall_s"]
                    )
                if a.hf:
                    mode, batch = a.hf.split(":")
                    out = a.workdir / f"hf-{r}.parquet"
                    cmd = bench.hf_cmd(a, model, data, out, mode, int(batch))
                    log = a.workdir / f"hf-{cond}-{r}.log"
                    times.setdefault(f"transformers {a.hf}", {}).setdefault(cond, []).append(
                        bench.timed(cmd, log)["wall_s"]
                    )
                if a.ov_python:
                    out = a.workdir / f"ov-{r}.parquet"
                    cmd = bench.ov_cmd(a, model, data, out, 2048)
                    log = a.workdir / f"ov-{cond}-{r}.log"
                    times.setdefault("OpenVINO GenAI", {}).setdefault(cond, []).append(
                        bench.timed(cmd, log)["wall_s"]
                    )
    print(f"\n{a.workload}, {a.rows} rows, {a.rounds} rounds; busy loop on CPU {a.busy_cpu}\n")
    print("| mode | quiet s | busy s | slowdown |\n|---|---|---|---|")
    for name, by in times.items():
        q, b = statistics.median(by["quiet"]), statistics.median(by["busy"])
        print(f"| {name} | {q:.2f} | {b:.2f} | {b / q:.2f}x |")
    report = {"workload": a.workload, "rows": a.rows, "busy_cpu": a.busy_cpu, "times": times}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
