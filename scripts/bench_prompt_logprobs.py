"""Prompt log-probabilities, whole processes: `batchgen run --task prompt-logprobs` against a
batched transformers forward (length-sorted, right-padded batches, log_softmax of the logits,
each batch size given tried), on bench_models' shapes and bench_workloads' prompts.

    python scripts/bench_prompt_logprobs.py                       # llama-55m, 192 mixed rows
    python scripts/bench_prompt_logprobs.py --rows 96 --pairs 3 --batch 4 8 16
    python scripts/bench_prompt_logprobs.py --threads 1      # both sides on one thread

Each pair runs batchgen, then every baseline batch size, each a fresh process; the table gives
each one's median wall time over the pairs, rows/s and prompt tokens/s, its median CPU time
(user + sys: on a loaded machine with --threads 1 the steadier figure), and the largest
difference of any token's logprob from batchgen's (float32 on the CPU: ~1e-5 is rounding).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_models  # noqa: E402
import bench_workloads  # noqa: E402

# The baseline, in its own process: ids by length, batches of `batch`, right padding.
BASELINE = """
import sys, time, torch, transformers, pyarrow as pa, pyarrow.parquet as pq
model, data, out, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if int(sys.argv[5]):
    torch.set_num_threads(int(sys.argv[5]))
hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
tok = transformers.AutoTokenizer.from_pretrained(model)
rows = pq.read_table(data).to_pylist()
ids = [tok(r["prompt"])["input_ids"] for r in rows]
order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
result = [None] * len(ids)
with torch.inference_mode():
    for lo in range(0, len(order), batch):
        part = order[lo : lo + batch]
        width = max(len(ids[i]) for i in part)
        x = torch.tensor([ids[i] + [0] * (width - len(ids[i])) for i in part])
        mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in part])
        lp = hf(input_ids=x, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
        got = lp.gather(-1, x[:, 1:, None])[..., 0]
        for j, i in enumerate(part):
            result[i] = [None] + got[j, : len(ids[i]) - 1].tolist()
pq.write_table(pa.table({"id": [r["id"] for r in rows], "prompt_logprobs": result}), out)
"""


def timed(cmd: list[str], cpu: dict[str, list[float]], name: str) -> float:
    """The command's wall time; its CPU time (user + sys, the process and its children) is
    appended to cpu[name]: on a machine loaded by others, the steadier figure at --threads 1."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    cpu.setdefault(name, []).append(used)
    return wall


def logprobs(path: Path) -> dict[int, list]:
    t = pq.read_table(path, columns=["id", "prompt_logprobs"])
    return dict(zip(t["id"].to_pylist(), t["prompt_logprobs"].to_pylist(), strict=True))


def max_diff(a: dict[int, list], b: dict[int, list]) -> float:
    return max(abs(x - y) for i in a for x, y in zip(a[i][1:], b[i][1:], strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--workload", default="mixed", choices=bench_workloads.WORKLOADS)
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    p.add_argument("--threads", type=int, default=0, help="torch threads of both (0: default)")
    a = p.parse_args()
    model = bench_models.cached(a.shape)
    vocab = bench_models.SHAPES[a.shape].config["vocab_size"]
    root = Path(tempfile.mkdtemp(prefix="bench-plp-"))
    data = root / "in.parquet"
    rows = bench_workloads.make_workload(a.workload, a.rows, vocab)
    pq.write_table(pa.table({"id": rows["id"], "prompt": rows["prompt"]}), data)
    runs: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for k in range(a.pairs):
        out = root / f"batchgen-{k}"
        cmd = [sys.executable, "-m", "batchgen.cli", "run", str(data), "-o", str(out)]
        cmd += ["--model", str(model), "--task", "prompt-logprobs", "--device", "cpu", "-q"]
        cmd += ["--threads", str(a.threads)] if a.threads else []
        runs.setdefault("batchgen", []).append(timed(cmd, cpu, "batchgen"))
        for b in a.batch:
            base = root / f"hf-b{b}-{k}.parquet"
            cmd = [sys.executable, "-c", BASELINE, str(model), str(data), str(base), str(b)]
            cmd.append(str(a.threads))
            name = f"transformers b{b}"
            runs.setdefault(name, []).append(timed(cmd, cpu, name))
    ours = logprobs(root / "batchgen-0")
    stats = json.loads((root / "batchgen-0" / ".batchgen" / "stats.json").read_text())
    tokens = sum(len(v) for v in ours.values())
    print(f"{a.rows} rows, {tokens} prompt tokens, {a.shape}, medians of {a.pairs} runs")
    phases = ("startup_s", "warmup_s", "prefill_s")
    times = ", ".join(f"{k} {stats.get(k, 0):.2f} s" for k in phases)
    print(f"batchgen stats: {stats.get('rows_per_s'):.1f} rows/s in its engine; {times}")
    for name, times in runs.items():
        m = statistics.median(times)
        diff = 0.0
        if name != "batchgen":
            diff = max_diff(ours, logprobs(root / f"hf-b{name.split('b')[-1]}-0.parquet"))
        c = statistics.median(cpu[name])
        line = f"{name:18s} {m:7.2f} s  {a.rows / m:7.1f} rows/s  {tokens / m:8.0f} tok/s"
        line += f"  cpu {c:6.2f} s  max |diff| {diff:.1e}"
        print(f"{line}  runs {', '.join(f'{t:.2f}' for t in times)}")
    best = min(statistics.median(t) for n, t in runs.items() if n != "batchgen")
    best_cpu = min(statistics.median(t) for n, t in cpu.items() if n != "batchgen")
    ours, ours_cpu = statistics.median(runs["batchgen"]), statistics.median(cpu["batchgen"])
    print(f"best baseline / batchgen: wall {best / ours:.2f}x, cpu {best_cpu / ours_cpu:.2f}x")


if __name__ == "__main__":
    main()
