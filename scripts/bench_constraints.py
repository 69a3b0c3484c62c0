"""The cost of structured outputs: the labeling workload of scripts/bench.py run by `batchgen
run` with and without `--choice`, A B A B, whole processes, medians of rows/s.

    python scripts/bench_constraints.py --pairs 2            # llama-55m shape, 192 rows, CPU

The labels are three of the bench tokenizer's words, so a constrained row writes one label
token and EOS; an unconstrained one writes its row's 1-4 tokens (EOS ignored). Both runs
compute the same prompts (a ~500-token shared instruction + a short row text), which is
most of the job; the figure is what a labeling job pays for exact labels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402
import bench_models  # noqa: E402

LABELS = "t5,t6,t7"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/batchgen-bench-constraints")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    a.device, a.dtype = "cpu", "float32"
    root = Path(a.workdir)
    root.mkdir(parents=True, exist_ok=True)
    model = bench_models.cached(a.model, "float32")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    data = root / "labeling.parquet"
    pq.write_table(pa.table(bench.make_workload("labeling", a.rows, vocab)), data)
    runs: dict[str, list[float]] = {"free": [], "choice": []}
    for i in range(a.pairs):
        for name, extra in (("free", ""), ("choice", f"--choice {LABELS}")):
            a.batchgen_args = extra
            out = root / f"{name}-{i}"
            r = bench.timed(bench.batchgen_cmd(a, model, data, out), root / f"{name}-{i}.log")
            rows = pq.read_table(out, columns=["text"]).column("text").to_pylist()
            if name == "choice":
                assert all(t in LABELS.split(",") for t in rows), "a row outside its labels"
            runs[name].append(a.rows / r["wall_s"])
            print(f"pair {i} {name:6s} {r['wall_s']:6.1f} s  {a.rows / r['wall_s']:5.2f} rows/s")
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"median rows/s: free {med['free']:.2f}, choice {med['choice']:.2f} "
          f"({med['choice'] / med['free']:.2f}x)")  # fmt: skip
    return med


if __name__ == "__main__":
    main()
