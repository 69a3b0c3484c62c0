"""The CTranslate2 script for the same job: a baseline of scripts/bench.py, run as a whole
process (load, tokenize, generate, write), set up the way CTranslate2 runs fastest.

    python scripts/ct2_baseline.py MODEL_DIR --convert-only --compute-type float32
    python scripts/ct2_baseline.py MODEL_DIR data.parquet out.parquet --batch-size 64

CTranslate2 runs its own model format, so the transformers checkpoint is converted once into
MODEL_DIR-ct2-COMPUTE_TYPE beside it (reconverted when the checkpoint's files change).
bench.py calls --convert-only before it times anything: conversion is a one-off, not part
of the job.

Reads `id`, `prompt` and `max_new_tokens` columns and generates exactly max_new_tokens
greedy tokens per row (`end_token=[]`: EOS can be generated and decoding goes on, the same
computation as batchgen's --ignore-eos); writes id, token_ids, text as hf_baseline.py does.

`generate_batch` takes one max_length per call, and with include_prompt_in_result=False it
forwards a batch's prompts at once only up to the shortest one (the rest go through the
decode loop a token at a time). So rows are sorted by (max_new_tokens, prompt length) and
run in chunks of batch-size rows, each chunk to its longest row, outputs cut per row: on the
issue-23 mixed job that was 1.4x faster than sorting by prompt length only.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
from bench_workloads import built_beside, write_baseline_output

COMPUTE_TYPES = ("float32", "float16", "bfloat16", "int8", "int8_float32")


def converted(model_dir: Path, compute_type: str) -> Path:
    """The CTranslate2 model for model_dir at compute_type, converted on first use."""
    import ctranslate2

    def convert(tmp: Path) -> None:
        converter = ctranslate2.converters.TransformersConverter(str(model_dir))
        converter.convert(str(tmp), quantization=compute_type)

    return built_beside(model_dir, f"ct2-{compute_type}", "ct2_source.json", convert)


def generate(gen, prompts: list[list[str]], news: list[int], batch: int) -> dict[int, list[int]]:
    order = sorted(range(len(prompts)), key=lambda i: (news[i], len(prompts[i])))
    out: dict[int, list[int]] = {}
    for s in range(0, len(order), batch):
        rows = order[s : s + batch]
        results = gen.generate_batch(
            [prompts[i] for i in rows],
            max_length=max(news[i] for i in rows),  # generated tokens only, given the flag
            sampling_topk=1,
            include_prompt_in_result=False,
            end_token=[],
        )
        for i, r in zip(rows, results, strict=True):
            out[i] = r.sequences_ids[0][: news[i]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("input", nargs="?")
    p.add_argument("output", nargs="?")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--compute-type", default="float32", choices=COMPUTE_TYPES)
    p.add_argument("--threads", type=int, default=None, help="default: every core")
    p.add_argument("--device", default="cpu")
    p.add_argument("--convert-only", action="store_true", help="convert (if needed) and exit")
    a = p.parse_args()
    if a.convert_only:
        print(converted(a.model_dir, a.compute_type))
        return
    if a.input is None or a.output is None:
        p.error("INPUT and OUTPUT are required unless --convert-only")
    t0 = time.perf_counter()
    import ctranslate2
    import transformers

    gen = ctranslate2.Generator(
        str(converted(a.model_dir, a.compute_type)),
        device=a.device,
        compute_type=a.compute_type,
        intra_threads=a.threads or os.cpu_count(),
    )
    tok = transformers.AutoTokenizer.from_pretrained(a.model_dir)
    table = pq.read_table(a.input)
    prompts = [
        tok.convert_ids_to_tokens(tok(t)["input_ids"]) for t in table.column("prompt").to_pylist()
    ]
    out = generate(gen, prompts, table.column("max_new_tokens").to_pylist(), a.batch_size)
    ids = [out[i] for i in range(len(prompts))]
    write_baseline_output(a.output, table.column("id"), ids, tok)
    print(f"ct2 batch {a.batch_size}: {len(ids)} rows in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
