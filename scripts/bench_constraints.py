"""The cost of structured outputs and of label scores: the labeling workload of
scripts/bench.py run by `batchgen run` free, with `--choice`, and with `--task score --choice`,
and transformers' scoring script (hf_baseline.py --mode score, batch 16), in turn (A B C D A B
C D), whole processes, medians of rows/s. The scores of batchgen and transformers are compared.

    python scripts/bench_constraints.py --pairs 2            # llama-55m shape, 192 rows, CPU

The labels are three of the bench tokenizer's words, so a constrained row writes one label
token and EOS; an unconstrained one writes its row's 1-4 tokens (EOS ignored). Both runs
compute the same prompts (a ~500-token shared instruction + a short row text), which is
most of the job; the figure is what a labeling job pays for exact labels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

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
    data, _ = bench.write_workload("labeling", a.rows, a.model, root)
    runs: dict[str, list[float]] = {"free": [], "choice": [], "score": [], "hf-score": []}
    variants = {
        "free": "",
        "choice": f"--choice {LABELS}",
        "score": f"--task score --choice {LABELS}",
    }
    for i in range(a.pairs):
        for name in runs:
            out = root / f"{name}-{i}"
            if name == "hf-score":
                cmd = [*bench.hf_cmd(a, model, data, out, "score", 16), "--labels", LABELS]
            else:
                a.batchgen_args = variants[name]
                cmd = bench.batchgen_cmd(a, model, data, out)
            r = bench.timed(cmd, root / f"{name}-{i}.log")
            if name == "choice":
                rows = (
                    pq.read_table(out, columns=["generated_text"])
                    .column("generated_text")
                    .to_pylist()
                )
                assert all(t in LABELS.split(",") for t in rows), "a row outside its labels"
            runs[name].append(a.rows / r["wall_s"])
            print(f"round {i} {name:8s} {r['wall_s']:6.1f} s  {a.rows / r['wall_s']:5.2f} rows/s")
        _check_scores(root / f"score-{i}", root / f"hf-score-{i}")
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        f"median rows/s: free {med['free']:.2f}, choice {med['choice']:.2f} "
        f"({med['choice'] / med['free']:.2f}x), score {med['score']:.2f}, transformers score "
        f"{med['hf-score']:.2f} ({med['score'] / med['hf-score']:.2f}x)"
    )
    return med


def _check_scores(ours: Path, theirs: Path) -> None:
    """batchgen's label probabilities against transformers' (softmax of its log-likelihoods)."""
    import math

    got = {
        r["id"]: dict(r["scores"])
        for r in pq.read_table(ours, columns=["id", "scores"]).to_pylist()
    }
    worst = 0.0
    for r in pq.read_table(theirs).to_pylist():
        top = max(r["scores"])
        w = [math.exp(x - top) for x in r["scores"]]
        ref = [x / sum(w) for x in w]
        worst = max(worst, *(abs(p - q) for p, q in zip(got[r["id"]].values(), ref, strict=True)))
    print(f"  scores: largest difference from transformers' {worst:.2e}")
    assert worst < 1e-3, worst


if __name__ == "__main__":
    main()
