"""The benchmark scripts on tiny models, run as whole processes the way they are run by hand
(tests import nothing from scripts/): scripts/bench.py end to end (`batchgen run` and the
transformers baseline): the report has its fields, the workloads their shapes, and greedy
float32 batchgen produced exactly the baseline's tokens, CTranslate2's, OpenVINO GenAI's and
llama.cpp's too where they are installed, and --baselines it cannot run are refused;
bench_compile eager; quant_fidelity's float reference agrees with itself and its int8 row is
reported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPTS / name), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def _tiny_bench(name: str, tmp_path: Path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    """`scripts/NAME` on the tiny Llama: 6 rows, one thread, work under tmp_path/work, models
    cached under tmp_path/models; the process and its JSON report."""
    out = tmp_path / "report.json"
    r = _script(
        name,
        *("--model", "tiny-llama", "--rows", 6, "--threads", 1),
        *("--workdir", tmp_path / "work", "--out", out, *args),
        env={"BATCHGEN_BENCH_CACHE": str(tmp_path / "models"), "BATCHGEN_NO_PEAK_PROBE": "1"},
    )
    return r, json.loads(out.read_text())


@pytest.mark.slow  # four whole processes (each imports torch and transformers): ~50 s
def test_bench_report_on_tiny_model(tmp_path):
    md, work = tmp_path / "bench.md", tmp_path / "work"
    r, report = _tiny_bench(
        "bench.py",
        tmp_path,
        *("--pairs", 1, "--baselines", "sorted:4", "--workload", "mixed,labeling"),
        *("--markdown", md),
    )
    assert report["model"] == "tiny-llama" and report["matmul_flops"] > 0
    assert [w["workload"] for w in report["workloads"]] == ["mixed", "labeling"]
    for w in report["workloads"]:
        data = pq.read_table(work / f"{w['workload']}.parquet").to_pydict()
        words = [p.split() for p in data["prompt"]]
        lens, news = [len(ws) for ws in words], data["max_new_tokens"]
        assert w["rows"] == len(lens) == 6 and data["id"] == list(range(6))
        if w["workload"] == "mixed":
            assert all(8 <= n <= 400 for n in lens) and all(4 <= n <= 128 for n in news)
        else:  # labeling: one shared 500-word instruction, then the row
            assert all(ws[:500] == words[0][:500] for ws in words)
            assert all(510 <= n <= 560 for n in lens) and all(1 <= n <= 4 for n in news)
        assert w["prompt_tokens"] == sum(lens) and w["output_tokens"] == sum(news)
        assert w["baseline"] == "hf-sorted batch 4" and len(w["peers"]) == 1
        assert w["batchgen_median_s"] > 0 and w["baseline_median_s"] > 0
        assert w["speedup"] > 0 and len(w["pair_speedups"]) == 1 and w["pair_speedups"][0] > 0
        assert w["floor_s"] > 0 and w["roofline_share"] > 0
        assert [r["engine"] for r in w["runs"]] == ["hf-sorted", "batchgen"]
        for run in w["runs"]:
            # greedy float32: batchgen's tokens are transformers' tokens, row for row
            assert run["rows_differing"] == 0, (w["workload"], run["engine"])
            assert run["wall_s"] > 0 and run["peak_rss_bytes"] > 0
        stats = w["runs"][1]["stats"]
        assert stats["rows"] == 6 and stats["rows_error"] == 0
        assert stats["prompt_tokens"] == w["prompt_tokens"]
        assert stats["output_tokens"] == w["output_tokens"]
        assert stats["decode_steps"] > 0 and stats["decode_s"] > 0
    assert "### mixed: 6 rows" in r.stdout and "### labeling: 6 rows" in r.stdout
    assert "| hf-sorted batch 4 |" in r.stdout
    assert "best transformers baseline (hf-sorted batch 4)" in r.stdout
    assert md.read_text() in r.stdout  # printed, and appended to --markdown


@pytest.mark.slow  # the conversion and three whole processes: ~30 s
def test_bench_ct2_baseline_on_tiny_model(tmp_path):
    pytest.importorskip("ctranslate2")
    work, cache = tmp_path / "work", tmp_path / "models"
    r, report = _tiny_bench(
        "bench.py", tmp_path, "--pairs", 1, "--baselines", "ct2:4", "--workload", "mixed"
    )
    (w,) = report["workloads"]
    assert [x["engine"] for x in w["runs"]] == ["ct2", "batchgen"]
    ct2 = w["runs"][0]
    assert ct2["batch_size"] == 4 and ct2["wall_s"] > 0 and ct2["peak_rss_bytes"] > 0
    # greedy float32, exactly max_new_tokens each: CTranslate2's tokens are batchgen's
    assert ct2["rows_differing"] == 0
    ids = pq.read_table(work / "mixed-ct2-4.parquet").to_pydict()
    news = pq.read_table(work / "mixed.parquet").column("max_new_tokens").to_pylist()
    assert ids["id"] == list(range(6)) and [len(t) for t in ids["token_ids"]] == news
    (peer,) = w["peers"]
    assert peer["engine"] == "CTranslate2" and peer["baseline"] == w["baseline"] == "ct2 batch 4"
    assert peer["speedup"] == w["speedup"] > 0
    assert "best CTranslate2 baseline (ct2 batch 4)" in r.stdout
    # converted once, beside the checkpoint, before the timed run
    assert (cache / "tiny-llama-float32-ct2-float32" / "model.bin").is_file()


# Peers run in their own environments (python given by the variable): bench.py's spec, the
# workload, its engine names and the converted model it caches beside the checkpoint.
PEERS = {
    "openvino": (
        "BATCHGEN_OV_PYTHON",
        "ov:256",
        "mixed",
        "ov",
        "OpenVINO GenAI",
        "ov batch 256",
        "tiny-llama-float32-ov-fp32/openvino_model.xml",
    ),
    "llamacpp": (
        "BATCHGEN_LCPP_PYTHON",
        "llamacpp:4",
        "labeling",
        "llamacpp",
        "llama.cpp",
        "llamacpp batch 4",
        "tiny-llama-float32-gguf-f32/model.gguf",
    ),
}


@pytest.mark.slow  # the conversion and three whole processes, in the peer's environment
@pytest.mark.parametrize("peer", sorted(PEERS))
def test_bench_peer_baseline_on_tiny_model(tmp_path, peer):
    """Greedy, f32 weights, compute and KV, exactly max_new_tokens each (on labeling, the
    shared instruction's cells reused across llama.cpp's slots): the peer's tokens are
    batchgen's."""
    env, spec, workload, engine, name, baseline, converted = PEERS[peer]
    if not os.environ.get(env):
        pytest.skip(f"{env} (the {name} environment's python) is not set")
    work, cache = tmp_path / "work", tmp_path / "models"
    r, report = _tiny_bench(
        "bench.py", tmp_path, "--pairs", 1, "--baselines", spec, "--workload", workload
    )
    (w,) = report["workloads"]
    assert [x["engine"] for x in w["runs"]] == [engine, "batchgen"]
    assert w["runs"][0]["rows_differing"] == 0
    ids = pq.read_table(work / f"{workload}-{spec.replace(':', '-')}.parquet").to_pydict()
    news = pq.read_table(work / f"{workload}.parquet").column("max_new_tokens").to_pylist()
    assert ids["id"] == list(range(6)) and [len(t) for t in ids["token_ids"]] == news
    (p,) = w["peers"]
    assert p["engine"] == name and p["baseline"] == baseline
    assert (cache / converted).is_file()


@pytest.mark.parametrize(
    ("baselines", "message"),
    [
        ("ct2:4", "needs CTranslate2: pip install ctranslate2"),
        ("ov:512", "needs --ov-python"),
        ("llamacpp:16", "needs --lcpp-python"),
        ("fast:4", "bad entry 'fast:4'"),
    ],
)
def test_bench_rejects_baselines_it_cannot_run(tmp_path, baselines, message, monkeypatch):
    monkeypatch.delenv("BATCHGEN_OV_PYTHON", raising=False)
    monkeypatch.delenv("BATCHGEN_LCPP_PYTHON", raising=False)
    # sys.modules[name] = None is how find_spec sees a package that is not installed
    hide = (
        "import runpy, sys; sys.modules['ctranslate2'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    cmd = [sys.executable, "-c", hide, str(SCRIPTS / "bench.py"), "--baselines", baselines]
    r = subprocess.run([*cmd, "--workdir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # refused before any model is built or run


def test_bench_compile_eager_on_tiny_model(model, tmp_path):
    prompts = tmp_path / "p.parquet"
    pq.write_table(
        pa.table({"prompt": ["the quick brown fox", "label this review:", "a"]}), prompts
    )
    out = tmp_path / "c.json"
    _script(
        "bench_compile.py",
        "--model",
        model,
        "--prompts",
        prompts,
        "--new-tokens",
        "5",
        "--modes",
        "eager",
        "--out",
        out,
    )
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert report["identical_tokens"] and r["mode"] == "eager"
    assert r["graphs"] == 0 and r["compile_s"] == 0 and r["warm_compile_s"] == 0
    assert r["cold_wall_s"] > 0 and r["warm_wall_s"] > 0
    assert r["warm_out_tok_s"] > 0 and r["warm_decode_tok_s"] > 0 and r["warm_ms_per_step"] > 0


def test_quant_fidelity_on_tiny_model(model, tmp_path):
    out = tmp_path / "q.json"
    r = _script(
        "quant_fidelity.py",
        "--model",
        model,
        "--backends",
        "torchao",
        "--methods",
        "int8",
        "--row-len",
        "32",
        "--n-prompts",
        "2",
        "--new-tokens",
        "3",
        "--out",
        out,
    )
    ref, int8 = json.loads(out.read_text())["results"]
    # the float reference against itself: every token agrees, no perplexity change
    assert ref["method"] == "none" and ref["ppl"] > 1 and ref["ppl_delta_pct"] == 0
    assert ref["top1_agreement"] == ref["greedy_agreement"] == 1.0
    assert int8["method"] == "int8" and int8["scheme"]["method"] == "int8"
    assert int8["linear_bytes"] < ref["linear_bytes"] and 0 < int8["top1_agreement"] <= 1
    assert "| torchao | int8 |" in r.stdout


@pytest.mark.slow  # two TP=1 and two TP=2 whole runs: ~40 s
def test_bench_tp_on_tiny_model(tmp_path):
    r, report = _tiny_bench("bench_tp.py", tmp_path)
    assert [x["tp"] for x in report["runs"]] == [1, 2, 1, 2]
    one, two = report["runs"][:2]
    assert one["collective_share"] is None and 0 < two["collective_share"] < 1
    assert 0 < two["weights_bytes_per_rank"] < 0.6 * one["weights_bytes_per_rank"]
    assert two["kv_cache_bytes_per_rank"] < one["kv_cache_bytes_per_rank"]
    assert all(x["rows_differing"] <= 1 for x in report["runs"])  # a near-tie may part
    assert report["slowdown"] > 0 and len(report["pair_ratios"]) == 2
    assert "TP/TP=1 wall time, medians" in r.stdout


@pytest.mark.slow  # two whole `batchgen run` processes: ~20 s
def test_bench_sweep_over_max_num_seqs_on_tiny_model(tmp_path):
    png = tmp_path / "sweep.png"
    r, report = _tiny_bench(
        "bench.py",
        tmp_path,
        "--workload",
        "mixed",
        "--sweep-max-num-seqs",
        "1,4",
        "--sweep-png",
        png,
    )
    (w,) = report["workloads"]
    assert [p["max_num_seqs"] for p in w["sweep"]] == [1, 4]
    for p in w["sweep"]:
        assert p["out_tok_s"] > 0 and p["wall_s"] > 0
        assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"] and 0 < p["tpot_p50_s"] <= p["tpot_p99_s"]
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size < 100_000
    assert "| max_num_seqs | wall s | out tok/s |" in r.stdout and "| 4 |" in r.stdout


def test_linear_layouts_study_runs_and_both_ways_agree():
    """scripts/bench_linear_layouts.py (docs/benchmarks.md's oneDNN-packed weights) on a tiny
    shape: both ways timed, their outputs within float32 rounding."""
    args = "--rows 2,4 --layers 1 --vocab 64 --threads 1 --reps 2"
    script = SCRIPTS / "bench_linear_layouts.py"
    r = subprocess.run([sys.executable, str(script), *args.split()], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| 2 ")]
    rows += [line.split("|") for line in r.stdout.splitlines() if line.startswith("| 4 ")]
    assert len(rows) == 2
    assert all(float(row[7]) < 1e-4 for row in rows)  # max diff column
