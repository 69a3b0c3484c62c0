"""The cost of vLLM's penalties in a step: the mixed workload with every row penalized
(repetition 1.2, presence 0.3, frequency 0.2), run through `LLM.generate` in process, with the
time spent in `engine.penalties.apply_penalties` summed. `--trees A,B` runs each source tree
(a `git worktree` of another commit) in its own process, alternating A B A B, and compares
token ids across them.

    python scripts/bench_penalties.py --trees /tmp/before,. --pairs 2   # llama-55m, 192 rows

A tree is put first on sys.path of a process started outside the repository (an editable
install's `batchgen` would otherwise be found from the working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_models  # noqa: E402
from bench_workloads import make_workload  # noqa: E402

CHILD = """
import json, sys, time
import batchgen.engine.model_runner as mr
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
a = json.loads(sys.argv[1])
spent = [0.0, 0]
apply = mr.apply_penalties
def timed(*args):
    t = time.perf_counter()
    out = apply(*args)
    spent[0] += time.perf_counter() - t
    spent[1] += 1
    return out
mr.apply_penalties = timed
w = a["workload"]
llm = LLM(a["model"], dtype="float32", device="cpu")
params = [
    SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=1.2,
                   presence_penalty=0.3, frequency_penalty=0.2)
    for n in w["max_new_tokens"]
]
t = time.perf_counter()
out = llm.generate(w["prompt"], params, use_tqdm=False)
print(json.dumps({"generate_s": time.perf_counter() - t, "penalties_s": spent[0],
                  "calls": spent[1], "tokens": [o.token_ids for o in out],
                  "source": mr.__file__}))
"""


def run(tree: Path, args: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        check=True,
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["source"].startswith(str(tree)), f"ran {out['source']}, not {tree}"
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--trees", default=".", help="comma-separated source trees (A,B)")
    a = p.parse_args(argv)
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    model = bench_models.cached(a.model)
    vocab = bench_models.SHAPES[a.model].config["vocab_size"]
    args = {"model": str(model), "workload": make_workload("mixed", a.rows, vocab)}
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for i in range(a.pairs):
        for t in trees:
            r = run(t, args)
            runs[t].append(r)
            print(
                f"[{i}] {t}: generate {r['generate_s']:.2f} s, penalties "
                f"{r['penalties_s']:.3f} s over {r['calls']} steps",
                flush=True,
            )
    first = runs[trees[0]][0]["tokens"]
    for t in trees:
        gen = statistics.median(r["generate_s"] for r in runs[t])
        pen = statistics.median(r["penalties_s"] for r in runs[t])
        same = sum(x == y for x, y in zip(runs[t][0]["tokens"], first, strict=True))
        print(
            f"{t}: generate median {gen:.2f} s, penalties median {pen:.3f} s "
            f"({1000 * pen / runs[t][0]['calls']:.1f} ms a step); rows equal to "
            f"{trees[0].name}'s: {same}/{len(first)}"
        )


if __name__ == "__main__":
    main()
