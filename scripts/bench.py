"""batchgen against the best transformers baseline, whole processes as a user runs them.

    python scripts/bench.py --workload mixed                      # CPU, the engine issue's job
    python scripts/bench.py --workload labeling,long-tail --pairs 2
    python scripts/bench.py --model qwen-0.5b --device cuda --dtype bfloat16   # on a GPU
    python scripts/bench.py --sweep-max-num-seqs 1,4,16,64,256   # latency against throughput

For each workload (a Parquet file of `id`, `prompt`, `max_new_tokens`; EOS ignored, so every
engine does the same work):

1. every transformers baseline of scripts/hf_baseline.py (`generate` in input order,
   `generate` on rows sorted by length, the continuous batching manager) runs once at each
   batch size of --baselines (default 8, 16 and 32 for each), and so does CTranslate2
   (scripts/ct2_baseline.py, `ct2:B`; by default at 16, 32 and 64 when it is installed,
   converted once before anything is timed), and so do OpenVINO GenAI (`ov:TOKENS`,
   --ov-python) and llama.cpp (`llamacpp:SLOTS`, --lcpp-python), each under its own
   interpreter; the fastest of each engine is its baseline;
2. then `batchgen run` and those baselines alternate, A B A B (A B C with CTranslate2),
   --pairs times: the machine is shared, so each headline is a ratio of the medians, with
   each pair's ratio beside it.

Every run is a fresh process (`batchgen run` via its CLI; the baseline via its script),
timed from start to exit, peak RSS from wait4. Outputs are compared token for token with
batchgen's (greedy). batchgen's own `.batchgen/stats.json` gives the per-phase times and the
compute shares; the floor is the job's matmul FLOPs at this machine's measured matmul rate.

With --sweep-max-num-seqs, no baseline runs: `batchgen run` runs once per value of
--max-num-seqs, and the sweep prints output tokens/s against p50/p99 TPOT and TTFT (from each
run's stats.json) and saves the curve as a PNG (--sweep-png, default WORKDIR/sweep-NAME.png):
the latency/throughput trade-off of the batch size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.layout import STATS_FILE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_models  # noqa: E402
from bench_report import markdown, plot_sweep, sweep_markdown  # noqa: E402
from bench_workloads import WORKLOADS, make_workload  # noqa: E402

HF_MODES = ("input", "sorted", "cb")
CT2 = "ct2"  # --baselines mode of scripts/ct2_baseline.py
OV = "ov"  # --baselines mode of scripts/ov_baseline.py (BATCH: its max_num_batched_tokens)
LCPP = "llamacpp"  # --baselines mode of scripts/llamacpp_baseline.py (BATCH: its slots)
ENGINE_NAMES = {"hf": "transformers", CT2: "CTranslate2", OV: "OpenVINO GenAI", LCPP: "llama.cpp"}


# Linux's ru_maxrss of a child counts the memory of the process it was forked from, so
# each run is started by this small launcher, whose own footprint is a bare interpreter.
_LAUNCHER = """import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)"""


def timed(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict:
    """Run cmd to completion (env: variables set over this process's): wall seconds and the
    process's peak RSS."""
    rss = log.with_suffix(".rss")
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.call(
            [sys.executable, "-c", _LAUNCHER, str(rss), *cmd],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
        )
    wall = time.perf_counter() - t0
    print(f"[bench] {log.stem}: exit {code} after {wall:.1f} s", flush=True)  # progress
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; log: {log}\n{log.read_text()[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": int(rss.read_text()) * 1024}


def batchgen_cmd(a, model: Path, data: Path, out: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "batchgen.cli",
        "run",
        str(data),
        "-o",
        str(out),
        "--model",
        str(model),
        "--id-column",
        "id",
        "--ignore-eos",
        "--max-new-tokens",
        "256",
        "--with-token-ids",
        "--quiet",
        "--overwrite",
        "--device",
        a.device,
        "--dtype",
        a.dtype,
        *a.batchgen_args.split(),
    ]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def hf_cmd(a, model: Path, data: Path, out: Path, mode: str, batch: int) -> list[str]:
    cmd = [
        sys.executable,
        str(HERE / "hf_baseline.py"),
        str(model),
        str(data),
        str(out),
        "--mode",
        mode,
        "--batch-size",
        str(batch),
        "--dtype",
        a.dtype,
        "--device",
        a.device,
    ]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def ct2_cmd(a, model: Path, data: Path | None, out: Path | None, batch: int) -> list[str]:
    """With data and out None: convert the checkpoint (once; untimed, before any run)."""
    cmd = [sys.executable, str(HERE / "ct2_baseline.py"), str(model)]
    cmd += ["--convert-only"] if data is None else [str(data), str(out), "--batch-size", str(batch)]
    cmd += ["--compute-type", a.dtype, "--device", a.device]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def ov_cmd(a, model: Path, data: Path | None, out: Path | None, batch: int) -> list[str]:
    """OpenVINO GenAI runs under its own interpreter (--ov-python); with data and out None:
    export the checkpoint (once; untimed, before any run)."""
    cmd = [a.ov_python, str(HERE / "ov_baseline.py"), str(model)]
    cmd += ["--convert-only"] if data is None else [str(data), str(out)]
    cmd += [] if data is None else ["--batched-tokens", str(batch)]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def lcpp_cmd(a, model: Path, data: Path | None, out: Path | None, slots: int) -> list[str]:
    """llama.cpp runs under its own interpreter (--lcpp-python); with data and out None:
    convert the checkpoint to GGUF (once; untimed, before any run)."""
    cmd = [a.lcpp_python, str(HERE / "llamacpp_baseline.py"), str(model)]
    cmd += ["--convert-only"] if data is None else [str(data), str(out), "--slots", str(slots)]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def family(mode: str) -> str:
    """The engine a --baselines mode runs: "hf" for every transformers mode."""
    return mode if mode in (CT2, OV, LCPP) else "hf"


def baseline_cmd(a, model: Path, data: Path, out: Path, mode: str, batch: int) -> list[str]:
    if mode == CT2:
        return ct2_cmd(a, model, data, out, batch)
    if mode == OV:
        return ov_cmd(a, model, data, out, batch)
    if mode == LCPP:
        return lcpp_cmd(a, model, data, out, batch)
    return hf_cmd(a, model, data, out, mode, batch)


def token_ids(path: Path) -> dict[int, list[int]]:
    t = pq.read_table(path, columns=["id", "token_ids"])
    return dict(zip(t.column("id").to_pylist(), t.column("token_ids").to_pylist(), strict=True))


def write_workload(name: str, rows: int, shape: str, root: Path) -> tuple[Path, dict]:
    """The workload's rows for the vocabulary of bench_models' shape, written to
    root/NAME.parquet; returns the file and the rows."""
    work = make_workload(name, rows, bench_models.SHAPES[shape].config["vocab_size"])
    data = root / f"{name}.parquet"
    pq.write_table(pa.table(work), data)
    return data, work


def mark_differing(runs: list[dict], ref: dict[int, list[int]]) -> None:
    """Each run's `ids` (token_ids) replaced by how many of ref's rows it differs on."""
    for r in runs:
        r["rows_differing"] = sum(r["ids"].get(i) != ids for i, ids in ref.items())
        del r["ids"]


def bench_workload(a, name: str, model: Path, root: Path, matmul_flops: float) -> dict:
    import roofline

    data, work = write_workload(name, a.rows, a.model, root)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    runs: list[dict] = []

    def run_batchgen(k: int) -> dict:
        out = root / f"{name}-batchgen"
        r = timed(batchgen_cmd(a, model, data, out), logs / f"{name}-batchgen-{k}.log")
        r.update(engine="batchgen", stats=json.loads((out / STATS_FILE).read_text()))
        r["ids"] = token_ids(out)
        runs.append(r)
        return r

    def run_base(mode: str, b: int, k: int) -> dict:
        engine = mode if family(mode) != "hf" else f"hf-{mode}"
        out = root / f"{name}-{engine}-{b}.parquet"
        cmd = baseline_cmd(a, model, data, out, mode, b)
        r = timed(cmd, logs / f"{name}-{engine}-{b}-{k}.log")
        r.update(engine=engine, mode=mode, batch_size=b, ids=token_ids(out))
        runs.append(r)
        return r

    best: dict[str, dict] = {}  # engine family ("hf", "ct2") -> its fastest exploration run
    for mode, b in a.baselines:
        r = run_base(mode, b, 0)
        fam = family(mode)
        if fam not in best or r["wall_s"] < best[fam]["wall_s"]:
            best[fam] = r
    bg, peers = [], {fam: [r] for fam, r in best.items()}
    for k in range(a.pairs):
        bg.append(run_batchgen(k))
        for fam, r in best.items() if k else ():  # each exploration run is its first B
            peers[fam].append(run_base(r["mode"], r["batch_size"], k))
    mark_differing(runs, bg[0]["ids"])
    bg_med = statistics.median(r["wall_s"] for r in bg)
    vs = [
        {
            "engine": ENGINE_NAMES[fam],
            "baseline": f"{hs[0]['engine']} batch {hs[0]['batch_size']}",
            "baseline_median_s": statistics.median(h["wall_s"] for h in hs),
            "speedup": statistics.median(h["wall_s"] for h in hs) / bg_med,
            "pair_speedups": [h["wall_s"] / b["wall_s"] for b, h in zip(bg, hs, strict=False)],
        }
        for fam, hs in peers.items()
    ]
    floor = roofline.job_floor_seconds(model, work["prompt"], work["max_new_tokens"], matmul_flops)
    return {
        "workload": name,
        "rows": a.rows,
        "prompt_tokens": sum(len(p.split()) for p in work["prompt"]),
        "output_tokens": sum(work["max_new_tokens"]),
        **min(vs, key=lambda p: p["baseline_median_s"]),  # the fastest engine's; all in peers
        "peers": vs,
        "batchgen_median_s": bg_med,
        "floor_s": floor,
        "roofline_share": floor / bg_med,
        "runs": runs,
    }


def sweep_workload(a, name: str, model: Path, root: Path) -> dict:
    """One `batchgen run` per --max-num-seqs value: throughput against TPOT and TTFT."""
    data, _ = write_workload(name, a.rows, a.model, root)
    (root / "logs").mkdir(exist_ok=True)
    points = []
    for v in (int(x) for x in a.sweep_max_num_seqs.split(",")):
        out = root / f"{name}-seqs-{v}"
        cmd = [*batchgen_cmd(a, model, data, out), "--max-num-seqs", str(v)]
        r = timed(cmd, root / "logs" / f"{name}-seqs-{v}.log")
        s = json.loads((out / STATS_FILE).read_text())
        point = {"max_num_seqs": v, "wall_s": r["wall_s"], "out_tok_s": s["output_tokens_per_s"]}
        point.update({k: s.get(k) for k in ("compile_s", "capture_s", "compile_cache", "mbu")})
        for key in ("ttft_s", "tpot_s"):
            point.update({f"{key[:4]}_{q}_s": s[key][q] for q in ("p50", "p99")})
        points.append(point)
    png = a.sweep_png or root / f"sweep-{name}.png"
    plot_sweep(points, png, f"{a.model}, {name}, {a.rows} rows, {a.device} {a.dtype}")
    return {"workload": name, "rows": a.rows, "sweep": points, "png": str(png)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--model", default="llama-55m", choices=sorted(bench_models.SHAPES))
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--pairs", type=int, default=2, help="batchgen/baseline pairs (A B A B)")
    p.add_argument(
        "--baselines",
        default=None,
        help=f"baseline runs to try, MODE:BATCH comma-separated, MODE one of {', '.join(HF_MODES)}"
        f" (transformers), {CT2} (CTranslate2), {OV} (OpenVINO GenAI, BATCH its tokens per "
        f"step) or {LCPP} (llama.cpp, BATCH its slots); the fastest of each engine is its "
        "baseline (default: each transformers mode at 8, 16 and 32, "
        f"{CT2} at 16, 32 and 64 when ctranslate2 is installed, {OV} at 512, 1024 and 2048 with "
        f"--ov-python, {LCPP} at 16, 32 and 64 with --lcpp-python)",
    )
    p.add_argument(
        "--ov-python",
        default=os.environ.get("BATCHGEN_OV_PYTHON"),
        help="the interpreter of a virtual environment with openvino-genai and optimum-intel "
        "(docs/benchmarks.md has the recipe); default $BATCHGEN_OV_PYTHON",
    )
    p.add_argument(
        "--lcpp-python",
        default=os.environ.get("BATCHGEN_LCPP_PYTHON"),
        help="the interpreter of a virtual environment with llama-cpp-python and the sdist's "
        "converter (docs/benchmarks.md has the recipe); default $BATCHGEN_LCPP_PYTHON",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batchgen-args", default="", help="extra `batchgen run` flags")
    p.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench")
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    p.add_argument("--markdown", type=Path, default=None, help="append the markdown here")
    p.add_argument(
        "--sweep-max-num-seqs",
        default=None,
        help="e.g. 1,4,16,64,256: one batchgen run per value (no baselines); throughput "
        "against p50/p99 TPOT and TTFT, printed and plotted",
    )
    p.add_argument("--sweep-png", type=Path, default=None, help="the sweep's plot (one workload)")
    a = p.parse_args(argv)
    has_ct2 = importlib.util.find_spec("ctranslate2") is not None
    if a.baselines is None:
        runs = [f"{m}:{b}" for m in HF_MODES for b in (8, 16, 32)]
        runs += [f"{CT2}:{b}" for b in (16, 32, 64)] if has_ct2 else []
        runs += [f"{OV}:{b}" for b in (512, 1024, 2048)] if a.ov_python else []
        runs += [f"{LCPP}:{b}" for b in (16, 32, 64)] if a.lcpp_python else []
        a.baselines = ",".join(runs)
    a.baselines = [parse_baseline(p, x) for x in a.baselines.split(",")]
    if not has_ct2 and any(m == CT2 for m, _ in a.baselines):
        p.error(f"--baselines {CT2}:B needs CTranslate2: pip install ctranslate2")
    if not a.ov_python and any(m == OV for m, _ in a.baselines):
        p.error(f"--baselines {OV}:B needs --ov-python (an OpenVINO GenAI environment)")
    if not a.lcpp_python and any(m == LCPP for m, _ in a.baselines):
        p.error(f"--baselines {LCPP}:B needs --lcpp-python (a llama-cpp-python environment)")
    return a


def parse_baseline(p: argparse.ArgumentParser, entry: str) -> tuple[str, int]:
    mode, _, batch = entry.strip().partition(":")
    if mode not in (*HF_MODES, CT2, OV, LCPP) or not batch.isdigit() or int(batch) < 1:
        p.error(
            f"--baselines: bad entry {entry!r}; want MODE:BATCH, MODE one of "
            f"{', '.join((*HF_MODES, CT2, OV, LCPP))}, e.g. sorted:16 or {CT2}:64"
        )
    return mode, int(batch)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import roofline
    import torch

    a.workdir.mkdir(parents=True, exist_ok=True)
    model = bench_models.cached(a.model, a.dtype, a.device)
    sweeping = a.sweep_max_num_seqs is not None
    ceilings = None if sweeping else roofline.measure(a.device, getattr(torch, a.dtype))
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, {a.device} {a.dtype}",
        "command": "python scripts/bench.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": a.model,
        "matmul_flops": ceilings.matmul_flops if ceilings else None,
        "workloads": [],
    }
    for mode, convert in ((CT2, ct2_cmd), (OV, ov_cmd), (LCPP, lcpp_cmd)):
        if not sweeping and any(m == mode for m, _ in a.baselines):
            subprocess.run(convert(a, model, None, None, 0), check=True, stdout=subprocess.DEVNULL)
    for name in a.workload.split(","):
        if sweeping:
            report["workloads"].append(sweep_workload(a, name, model, a.workdir))
        else:
            flops = ceilings.matmul_flops
            report["workloads"].append(bench_workload(a, name, model, a.workdir, flops))
        if a.out:
            a.out.write_text(json.dumps(report, indent=1))
    text = sweep_markdown(report) if sweeping else markdown(report)
    print(text)
    if a.markdown:
        with a.markdown.open("a") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
