"""The benchmark's workloads: Parquet rows of `id`, `prompt`, `max_new_tokens` in the shapes
batch jobs have (scripts/bench.py, bench_tp.py, profile_engine.py, bench_constraints.py), and
the file a baseline writes back (`write_baseline_output`: `id`, `token_ids`, `text`)."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORKLOADS = ("mixed", "labeling", "long-tail")


def _words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"t{rng.randrange(2, vocab)}" for _ in range(n))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(0.0, sigma) * median)))


def make_workload(name: str, n: int, vocab: int, seed: int = 0) -> dict[str, list]:
    """One word = one token with bench_models' word tokenizer."""
    rng = random.Random(seed)
    prompts, news = [], []
    if name == "mixed":  # 8-400 words (median ~50), 4-128 new tokens (median ~27)
        for _ in range(n):
            prompts.append(_words(rng, _lognormal(rng, 50, 0.9, 8, 400), vocab))
            news.append(_lognormal(rng, 27, 0.8, 4, 128))
    elif name == "labeling":  # a ~500-token shared instruction + a short row, 1-4 new tokens
        instruction = _words(rng, 500, vocab)
        for _ in range(n):
            prompts.append(f"{instruction} {_words(rng, rng.randint(10, 60), vocab)}")
            news.append(rng.randint(1, 4))
    elif name == "long-tail":  # most rows short; 1 in 20 a 1000-token prompt, 256 new tokens
        for _ in range(n):
            if rng.random() < 0.05:
                prompts.append(_words(rng, 1000, vocab))
                news.append(256)
            else:
                prompts.append(_words(rng, rng.randint(10, 80), vocab))
                news.append(rng.randint(8, 64))
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return {"id": list(range(n)), "prompt": prompts, "max_new_tokens": news}


def write_baseline_output(path: str | Path, ids: pa.Array, tokens: list[list[int]], tok) -> None:
    """A baseline's results: each row's id, generated token ids and their text (tok decodes)."""
    table = pa.table(
        {
            "id": ids,
            "token_ids": pa.array(tokens, pa.list_(pa.int64())),
            "text": tok.batch_decode(tokens, skip_special_tokens=True),
        }
    )
    pq.write_table(table, path)


def built_beside(model_dir: Path, suffix: str, marker: str, build: Callable[[Path], None]) -> Path:
    """MODEL_DIR-SUFFIX beside the checkpoint: another engine's copy of it, built by
    build(folder) on first use and again when the checkpoint's files (names, sizes, times)
    change; the stamp they had is kept in the folder's `marker` file. Built under a temporary
    name and renamed, so an interrupted build is never taken for a finished one."""
    out = model_dir.with_name(f"{model_dir.name}-{suffix}")
    stamp = sorted(
        [p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in model_dir.iterdir() if p.is_file()
    )
    if (out / marker).is_file() and json.loads((out / marker).read_text()) == stamp:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / marker).write_text(json.dumps(stamp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
