"""The benchmark scripts on tiny models. scripts/bench.py end to end (whole processes:
`batchgen run` and the transformers baseline): the report has its fields and greedy float32
batchgen produced exactly the baseline's tokens. Plus the workload and roofline arithmetic,
quant_fidelity's teacher-forced log-probs against transformers, and bench_compile eager."""

import functools
import json

import bench
import bench_compile
import bench_models
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import quant_fidelity
import roofline
import torch
import transformers

from batchgen.model.loader import load_model


@pytest.mark.slow  # four whole processes (each imports torch and transformers): ~50 s
def test_bench_report_on_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_models, "DEFAULT_CACHE", tmp_path / "models")
    small = functools.partial(roofline.measure, copy_bytes=16 << 20, matmul_n=128, reps=2)
    monkeypatch.setattr(roofline, "measure", small)
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    report = bench.main([
        "--model", "tiny-llama", "--rows", "6", "--pairs", "1", "--baselines", "sorted:4",
        "--workload", "mixed,labeling", "--workdir", str(tmp_path / "work"), "--threads", "1",
        "--out", str(out), "--markdown", str(md),
    ])  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["model"] == "tiny-llama" and report["matmul_flops"] > 0
    assert [w["workload"] for w in report["workloads"]] == ["mixed", "labeling"]
    vocab = bench_models.SHAPES["tiny-llama"].config["vocab_size"]
    for w in report["workloads"]:
        work = bench.make_workload(w["workload"], 6, vocab)
        assert w["rows"] == 6
        assert w["prompt_tokens"] == sum(len(p.split()) for p in work["prompt"])
        assert w["output_tokens"] == sum(work["max_new_tokens"])
        assert w["baseline"] == "hf-sorted batch 4"
        assert w["batchgen_median_s"] > 0 and w["baseline_median_s"] > 0
        assert w["speedup"] > 0 and len(w["pair_speedups"]) == 1 and w["pair_speedups"][0] > 0
        assert w["floor_s"] > 0 and w["roofline_share"] > 0
        assert [r["engine"] for r in w["runs"]] == ["hf-sorted", "batchgen"]
        for r in w["runs"]:
            # greedy float32: batchgen's tokens are transformers' tokens, row for row
            assert r["rows_differing"] == 0, (w["workload"], r["engine"])
            assert r["wall_s"] > 0 and r["peak_rss_bytes"] > 0
        stats = w["runs"][1]["stats"]
        assert stats["rows"] == 6 and stats["rows_error"] == 0
        assert stats["prompt_tokens"] == w["prompt_tokens"]
        assert stats["output_tokens"] == w["output_tokens"]
        assert stats["decode_steps"] > 0 and stats["decode_s"] > 0
    text = capsys.readouterr().out
    assert "### mixed: 6 rows" in text and "### labeling: 6 rows" in text
    assert "| hf-sorted batch 4 |" in text and "best baseline (hf-sorted batch 4)" in text
    assert md.read_text() == text  # printed, and appended to --markdown


@pytest.mark.parametrize("name", bench.WORKLOADS)
def test_workload_is_seeded_and_in_range(name):
    a = bench.make_workload(name, 200, 1000, seed=3)
    assert a == bench.make_workload(name, 200, 1000, seed=3)
    assert a != bench.make_workload(name, 200, 1000, seed=4)
    assert a["id"] == list(range(200)) and len(a["prompt"]) == len(a["max_new_tokens"]) == 200
    words = [p.split() for p in a["prompt"]]
    assert all(t[0] == "t" and 2 <= int(t[1:]) < 1000 for ws in words for t in ws)
    lens, news = [len(ws) for ws in words], a["max_new_tokens"]
    if name == "mixed":
        assert all(8 <= n <= 400 for n in lens) and all(4 <= n <= 128 for n in news)
    elif name == "labeling":  # one shared 500-word instruction, then the row
        assert all(ws[:500] == words[0][:500] for ws in words)
        assert all(510 <= n <= 560 for n in lens) and all(1 <= n <= 4 for n in news)
    else:  # long-tail: short rows, and a few 1000-token prompts with 256 new tokens
        long = [(n, k) for n, k in zip(lens, news, strict=True) if n == 1000]
        assert long and all(k == 256 for _, k in long)
        short = [(n, k) for n, k in zip(lens, news, strict=True) if n != 1000]
        assert all(10 <= n <= 80 and 8 <= k <= 64 for n, k in short)


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        bench.make_workload("nope", 4, 100)


def test_decode_bound_counts_live_rows_and_their_cache():
    cost = roofline.ModelCost(layer_params=100, head_params=20, kv_bytes_per_token=8,
                              attn_width=2, dtype_bytes=2)  # fmt: skip
    c = roofline.Ceilings("cpu", "float32", bandwidth_Bps=1e3, matmul_flops=1e12, copy_bytes=0,
                          matmul_n=0)  # fmt: skip
    # rows (prompt 10, 3 new) and (prompt 4, 2 new): step 1 has both, step 2 only the first
    bound = roofline.decode_bound([[(10, 3), (4, 2)]], cost, c)
    assert bound.steps == 2 and bound.tokens == 3
    assert bound.bytes == 2 * 240 + (11 + 5 + 12) * 8
    assert bound.flops == 2 * 120 * 3 + 4 * 2 * (11 + 5 + 12)
    assert bound.seconds == pytest.approx(bound.bytes / 1e3) and bound.memory_bound_steps == 2


@pytest.mark.parametrize("family", ["llama", "gpt2", "sliding-window"])
def test_teacher_forced_matches_transformers(tiny_dirs, window_dir, family):
    """quant_fidelity's perplexity path (the rows decoding one token per step on the paged
    cache, block tables growing past a block) gives transformers' log-probs and argmax."""
    d = window_dir if family == "sliding-window" else tiny_dirs[family]
    model = load_model(d, torch.float32, torch.device("cpu"))
    rows = torch.randint(2, 500, (3, 37), generator=torch.Generator().manual_seed(0))
    logp, top1 = quant_fidelity.teacher_forced(model, rows, block_size=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        ref = hf(rows).logits.float().log_softmax(-1)[:, :-1]
    assert logp.shape == top1.shape == (3, 36)
    torch.testing.assert_close(logp, ref.gather(-1, rows[:, 1:, None])[..., 0])
    assert torch.equal(top1, ref.argmax(-1))


def test_bench_compile_eager_on_tiny_model(tiny_dirs, tmp_path):
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["the quick brown fox", "label this review:", "a"]}),
                   prompts)  # fmt: skip
    report = bench_compile.main(["--model", str(tiny_dirs["llama"]), "--prompts", str(prompts),
                                 "--new-tokens", "5", "--modes", "eager",
                                 "--out", str(tmp_path / "c.json")])  # fmt: skip
    assert json.loads((tmp_path / "c.json").read_text()) == report
    (r,) = report["results"]
    assert report["identical_tokens"] and r["mode"] == "eager"
    assert r["graphs"] == 0 and r["compile_s"] == 0 and r["warm_compile_s"] == 0
    assert r["cold_wall_s"] > 0 and r["warm_wall_s"] > 0
    assert r["warm_out_tok_s"] > 0 and r["warm_decode_tok_s"] > 0 and r["warm_ms_per_step"] > 0
