"""`batchgen report OUT`: a self-contained page from a run's or a merged job's metrics; merge
combines the shards' latency histograms, MFU/MBU and step timelines."""

import html
import re
import shlex

import pyarrow.parquet as pq
from helpers import (
    EAGER,
    FAST,
    assert_one_line_error,
    prompts,
    read_stats,
    run_cli,
    run_job,
    write_parquet,
)

from batchgen.data.layout import REPORT_FILE, STATS_FILE, STEPS_FILE

PEAKS = ("--peak-tflops", 1, "--peak-bandwidth-gbs", 10)


def _check_page(path) -> str:
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # self-contained: every image inline, nothing fetched
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)
    assert len(re.findall(r'<img alt="" src="data:image/png;base64,', page)) == 5
    for words in ("TTFT p50 / p90 / p99 / max", "MFU", "Roofline", "Batch and KV cache"):
        assert words in page, words
    return page


def test_run_prints_the_hint_and_report_writes_the_page(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(12)})
    out = tmp_path / "out"
    flags = ("--model", model, *EAGER, "--with-timings", "--max-num-seqs", 4, *PEAKS)
    r = run_cli("run", src, "-o", out, *flags)
    assert f"plots and metrics: batchgen report {out}" in r.stdout
    r = run_cli("report", out)
    assert r.stdout.strip() == f"wrote {out / REPORT_FILE}"
    page = _check_page(out / REPORT_FILE)
    stats = read_stats(out)
    assert f"{stats['mfu']:.2%}" in page
    # REPORT_FILE is the output's own file: a rerun finds the job complete, --overwrite clears it
    run_cli("run", src, "-o", out, *flags)
    run_cli("run", src, "-o", out, *flags, "--overwrite", "--limit", 2)
    assert not (out / REPORT_FILE).exists()


def test_report_names_the_fix_when_there_is_nothing_to_report(tmp_path):
    r = run_cli("report", tmp_path, exit_code=2)
    assert_one_line_error(r, f"{STATS_FILE} not found", "batchgen run")
    (tmp_path / "shard-00000-of-00002").mkdir()
    r = run_cli("report", tmp_path, exit_code=2)
    assert_one_line_error(r, f"batchgen merge {tmp_path}")


def test_merged_shards_report_as_one_job(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(10)})
    out = tmp_path / "out"
    for i in range(2):
        run_job(src, out, model, "--shard", f"{i}/2", "--max-new-tokens", 5, *PEAKS)
    shards = [read_stats(out / f"shard-0000{i}-of-00002") for i in range(2)]
    run_cli("merge", out)
    stats = read_stats(out)
    hist = stats["latency_histograms"]["latency_s"]
    assert sum(hist["counts"].values()) == stats["rows"] == 10
    assert stats["ttft_s"]["p50"] <= stats["ttft_s"]["p99"] <= stats["ttft_s"]["max"]
    assert stats["latency_s"]["max"] == max(s["latency_s"]["max"] for s in shards)
    assert stats["model_flops"] == sum(s["model_flops"] for s in shards)
    flops_s = sum(s["model_flops_s"] for s in shards)
    assert abs(stats["mfu"] - stats["model_flops"] / flops_s / 1e12) < 1e-12
    assert 0 < stats["mbu"] <= 1 and stats["peak_flops"] == 1e12
    steps = pq.read_table(out / STEPS_FILE).to_pydict()
    assert len(steps["t_s"]) == sum(s["steps"] for s in shards)
    assert sorted(set(steps["shard"])) == [0, 1] and steps["t_s"] == sorted(steps["t_s"])
    # the later shard's steps come after the earlier one's start on the one clock
    assert min(t for t, s in zip(steps["t_s"], steps["shard"], strict=True) if s == 1) > 0
    run_cli("report", out)
    page = _check_page(out / REPORT_FILE)
    assert "2 shards merged" in page
    # the Job line: one run per shard, then the merge
    assert "--shard I/2" in page and f"I = 0 to 1, then: batchgen merge {out}" in page


def test_the_job_line_is_a_command_that_reruns_the_job(model, tmp_path):
    """The page's "Job" command, run as printed, is the same job (every row done before): no
    `--model None`, no option dropped, a template's and a stop string's newline kept."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(6), "key": list("abcdef")})
    out = tmp_path / "out"
    options = ("--template", "Q: {{ prompt }}\\nA:", "--stop", "\\n", "--stop", "x y")
    options += ("--id-column", "key", "--passthrough", "prompt,key", "--limit", 5, "--n", 2)
    options += ("--temperature", 0.8, "--seed", 3, "--top-p", 0.9, "--max-new-tokens", 5)
    options += ("--logit-bias", '{"5": 2.5}', "--presence-penalty", 0.5, "--with-token-ids")
    run_job(src, out, model, *options)
    run_cli("report", out)
    page = (out / REPORT_FILE).read_text()
    line = html.unescape(re.search(r"<h2>Job</h2>\s*<pre>(.*?)</pre>", page, re.S)[1])
    words = shlex.split(line)
    assert words[:2] == ["batchgen", "run"] and "None" not in words
    assert words.count("--stop") == 2 and "--logit-bias" in words and "--model" in words
    r = run_cli(*words[1:], *FAST)
    assert "all 10 rows were done before" in r.stdout  # 5 rows, 2 samples each
