"""Embeddings, whole processes: `batchgen run --task embed` against sentence-transformers'
`encode` (its own length sorting, each batch size given tried), on a bench_models shape saved
as a sentence-transformers checkpoint (Transformer, last-token Pooling, Normalize: a decoder
embedding model's layout) and bench_workloads' mixed-length prompts.

    python scripts/bench_embed.py                                  # llama-55m, 10k mixed rows
    python scripts/bench_embed.py --rows 1000 --pairs 2 --batch 16 64

Each pair runs batchgen, then every baseline batch size, each a fresh process (A B A B); the
table gives each one's median wall time over the pairs, rows/s and prompt tokens/s, and the
lowest cosine between batchgen's embedding of a row and sentence-transformers' (float32 on
the CPU: 1 - 1e-6 is rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_models  # noqa: E402
import bench_workloads  # noqa: E402

# The baseline, in its own process: encode sorts the texts by length itself.
BASELINE = """
import sys, pyarrow as pa, pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer
model, data, out, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
st = SentenceTransformer(model, device="cpu")
rows = pq.read_table(data).to_pylist()
emb = st.encode([r["prompt"] for r in rows], batch_size=batch, convert_to_numpy=True)
pq.write_table(pa.table({"id": [r["id"] for r in rows], "embedding": emb.tolist()}), out)
"""


def build_st_model(causal: Path, out: Path) -> Path:
    """causal's decoder as a sentence-transformers checkpoint: last-token pooling, normalized;
    the tokenizer without a chat template (sentence-transformers 5 would wrap each text)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    t = Transformer(str(causal))
    t.tokenizer.chat_template = None
    pool = Pooling(t.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[t, pool, Normalize()], device="cpu").save(str(out))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def embeddings(path: Path) -> dict[int, np.ndarray]:
    t = pq.read_table(path, columns=["id", "embedding"])
    rows = zip(t["id"].to_pylist(), t["embedding"].to_pylist(), strict=True)
    return {i: np.asarray(e, dtype=np.float64) for i, e in rows}


def min_cosine(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float:
    return min(float(a[i] @ b[i] / np.linalg.norm(a[i]) / np.linalg.norm(b[i])) for i in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--workload", default="mixed", choices=bench_workloads.WORKLOADS)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    a = p.parse_args()
    causal = bench_models.cached(a.shape)
    vocab = bench_models.SHAPES[a.shape].config["vocab_size"]
    root = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    model = build_st_model(causal, root / "st")
    data = root / "in.parquet"
    rows = bench_workloads.make_workload(a.workload, a.rows, vocab)
    pq.write_table(pa.table({"id": rows["id"], "prompt": rows["prompt"]}), data)
    runs: dict[str, list[float]] = {}
    for k in range(a.pairs):
        out = root / f"batchgen-{k}"
        cmd = [sys.executable, "-m", "batchgen.cli", "run", str(data), "-o", str(out)]
        cmd += ["--model", str(model), "--task", "embed", "--device", "cpu", "-q"]
        runs.setdefault("batchgen", []).append(timed(cmd))
        for b in a.batch:
            base = root / f"st-b{b}-{k}.parquet"
            cmd = [sys.executable, "-c", BASELINE, str(model), str(data), str(base), str(b)]
            runs.setdefault(f"sentence-tf b{b}", []).append(timed(cmd))
    ours = embeddings(root / "batchgen-0")
    stats = json.loads((root / "batchgen-0" / ".batchgen" / "stats.json").read_text())
    tokens = stats["prompt_tokens"]
    print(f"{a.rows} rows, {tokens} prompt tokens, {a.shape}, medians of {a.pairs} runs")
    best = min(statistics.median(t) for n, t in runs.items() if n != "batchgen")
    for name, times in runs.items():
        m = statistics.median(times)
        cos = 1.0
        if name != "batchgen":
            cos = min_cosine(ours, embeddings(root / f"st-b{name.split('b')[-1]}-0.parquet"))
        line = f"{name:18s} {m:7.2f} s  {a.rows / m:7.1f} rows/s  {tokens / m:8.0f} tok/s"
        print(f"{line}  min cos {cos:.7f}  runs {', '.join(f'{t:.2f}' for t in times)}")
    speedup = best / statistics.median(runs["batchgen"])
    print(f"batchgen vs the best sentence-transformers batch: {speedup:.2f}x")


if __name__ == "__main__":
    main()
