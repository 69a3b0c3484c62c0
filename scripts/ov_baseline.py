"""The OpenVINO GenAI script for the same job: a baseline of scripts/bench.py, run as a whole
process (load, tokenize, generate, write), set up the way OpenVINO GenAI runs best on a CPU.

    OVPY=/path/to/openvino-venv/bin/python
    $OVPY scripts/ov_baseline.py MODEL_DIR --convert-only
    $OVPY scripts/ov_baseline.py MODEL_DIR data.parquet out.parquet --batched-tokens 2048

OpenVINO GenAI lives in its own virtual environment (optimum-intel pins a torchvision that
does not match batchgen's torch; recipe in docs/benchmarks.md), so scripts/bench.py runs this
script with `--ov-python`. The transformers checkpoint is exported once into
MODEL_DIR-ov-fp32 beside it (`optimum-cli export openvino --weight-format fp32`, re-exported
when the checkpoint's files change); bench.py calls --convert-only before it times anything.

The engine is `ContinuousBatchingPipeline` (paged attention, dynamic split-fuse, prefix
caching), every precision forced to f32 (weights, compute and KV: its CPU defaults are bf16
compute and a u8 KV cache, whose ids differ from fp32 greedy). Rows go in pre-tokenized by
transformers' tokenizer, as every engine of the benchmark gets them, one `GenerationConfig`
per row: exactly max_new_tokens greedy tokens (`ignore_eos`, and no `min_new_tokens`, which
bans EOS rather than ignoring it), the same computation as batchgen's --ignore-eos.
`--batched-tokens` is `max_num_batched_tokens`, the one knob that matters (its default 256
starves prefill beside ~200 decodes); bench.py tries several.
Writes id, token_ids, text as hf_baseline.py does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from bench_workloads import built_beside, write_baseline_output

F32 = "f32"


def exported(model_dir: Path) -> Path:
    """The OpenVINO IR of model_dir (fp32 weights), exported on first use."""

    def export(tmp: Path) -> None:
        cli = Path(sys.executable).with_name("optimum-cli")
        cmd = [str(cli), "export", "openvino", "--model", str(model_dir)]
        cmd += ["--task", "text-generation-with-past", "--weight-format", "fp32", str(tmp)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    return built_beside(model_dir, "ov-fp32", "ov_source.json", export)


def pipeline(ir: Path, batched_tokens: int, threads: int, kv_gb: int):
    import openvino_genai as ov_genai

    sc = ov_genai.SchedulerConfig()
    sc.cache_size = kv_gb
    sc.max_num_batched_tokens = batched_tokens
    sc.max_num_seqs = 256
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = True
    props = {
        "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1,
        "INFERENCE_PRECISION_HINT": F32,
        "KV_CACHE_PRECISION": F32,
        "KEY_CACHE_PRECISION": F32,
        "VALUE_CACHE_PRECISION": F32,
    }
    return ov_genai.ContinuousBatchingPipeline(str(ir), sc, "CPU", props)


def generate(pipe, prompts: list[list[int]], news: list[int]) -> list[list[int]]:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    inputs, configs = [], []
    for ids, n in zip(prompts, news, strict=True):
        inputs.append(ov.Tensor(np.asarray([ids], dtype=np.int64)))
        gc = ov_genai.GenerationConfig()
        # ignore_eos alone: EOS can be drawn and decoding goes on. min_new_tokens would ban
        # EOS instead, another argmax wherever EOS wins (a row of the tiny test model).
        gc.max_new_tokens = n
        gc.ignore_eos = True
        gc.do_sample = False
        configs.append(gc)
    results = pipe.generate(inputs, configs)
    return [list(r.m_generation_ids[0])[:n] for r, n in zip(results, news, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("input", nargs="?")
    p.add_argument("output", nargs="?")
    p.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=None, help="default: every core")
    p.add_argument("--kv-gb", type=int, default=2, help="KV cache size (cache_size), GB")
    p.add_argument("--convert-only", action="store_true", help="export (if needed) and exit")
    a = p.parse_args()
    if a.convert_only:
        print(exported(a.model_dir))
        return
    if a.input is None or a.output is None:
        p.error("INPUT and OUTPUT are required unless --convert-only")
    t0 = time.perf_counter()
    import transformers

    pipe = pipeline(exported(a.model_dir), a.batched_tokens, a.threads or os.cpu_count(), a.kv_gb)
    tok = transformers.AutoTokenizer.from_pretrained(a.model_dir)
    table = pq.read_table(a.input)
    prompts = [tok(t)["input_ids"] for t in table.column("prompt").to_pylist()]
    ids = generate(pipe, prompts, table.column("max_new_tokens").to_pylist())
    write_baseline_output(a.output, table.column("id"), ids, tok)
    print(
        f"openvino genai {a.batched_tokens} tokens/step: {len(ids)} rows in "
        f"{time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
