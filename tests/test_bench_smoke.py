"""scripts/bench.py on a tiny model: the report has its fields, and every engine
produced exactly the workload's tokens. Plus the workload and roofline arithmetic."""

import json
import random

import bench
import pytest
import roofline


def test_bench_report_on_tiny_model(tmp_path, capsys):
    out = tmp_path / "bench.json"
    reports = bench.main([
        "--model", "tiny-llama", "--cache-root", str(tmp_path / "models"), "--device", "cpu",
        "--n-prompts", "5", "--prompt-len", "16:48:20", "--out-len", "3:9:5",
        "--hf-batch-size", "2", "--no-compile", "--in-process",
        "--copy-mib", "16", "--matmul-n", "128", "--out", str(out),
        "--markdown", str(tmp_path / "bench.md"), "--schedule", "static,continuous,continuous-prefix", "--shared-prefix", "16",
    ])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(reports, default=str))
    (r,) = reports
    assert r["errors"] == {}
    assert set(r["results"]) == {"roofline", "batchgen", "batchgen-continuous",
                                 "batchgen-continuous-prefix", "hf@2", "hf-static@2"}  # fmt: skip
    assert r["results"]["batchgen-continuous-prefix"]["prefix_tokens_saved"] == 16 * 4
    wanted = r["workload"]["output"]["total"]
    for key, res in r["results"].items():
        if key != "roofline":
            assert res["tokens_match"], key  # same per-row token counts as the workload
            assert sum(res["out_lens"]) == wanted
    runs = {(row["engine"], row["run"]) for row in r["rows"]}
    assert runs == {
        ("batchgen", "cold"),
        ("batchgen", "warm"),
        ("batchgen-continuous", "cold"),
        ("batchgen-continuous", "warm"),
        ("batchgen-continuous-prefix", "cold"),
        ("batchgen-continuous-prefix", "warm"),
        ("hf", "warm"),
        ("hf-static", "warm"),
    }
    for row in r["rows"]:
        assert row["output_tok_s"] > 0 and row["total_tok_s"] > row["output_tok_s"]
        assert row["ttfr_s"] is not None and 0 < row["ttfr_s"] <= row["wall_s"]
        assert row["peak_mem_bytes"] > 0
        assert 0 < row["prompt_padding_eff"] <= 1 and 0 < row["decode_row_eff"] <= 1
        assert 0 < row["prompt_padding_eff"] <= 1 and 0 < row["decode_row_eff"] <= 1
    assert r["headline"]["ratio"] > 0 and set(r["headline"]["per_variant"]) == {
        "hf@2",
        "hf-static@2",
    }
    assert r["ceilings"]["bandwidth_Bps"] > 0 and r["ceilings"]["matmul_flops"] > 0
    rl = r["roofline"]
    assert rl["decode_bound"]["seconds"] > 0 and rl["decode_achieved_s"] > 0
    assert rl["decode_bound"]["tokens"] == wanted - r["workload"]["n"]  # first tokens: prefill
    assert rl["decode_frac_of_bound"] > 0
    text = capsys.readouterr().out
    assert "Headline: batchgen / transformers" in text and "| decode |" in text
    assert (tmp_path / "bench.md").read_text().strip() == text.strip()


def test_workload_is_seeded_and_in_range():
    a = bench.make_workload(200, (16, 1024, 96), (16, 256, 48), 1.0, 0.8, 1000, seed=3)
    b = bench.make_workload(200, (16, 1024, 96), (16, 256, 48), 1.0, 0.8, 1000, seed=3)
    assert a == b
    assert all(16 <= n <= 1024 for n in a.prompt_lens) and all(16 <= n <= 256 for n in a.new_tokens)
    assert all(2 <= t < 1000 for p in a.prompts for t in p)
    assert bench.parse_lengths("128") == (128, 128, 128)
    with pytest.raises(Exception, match="MIN:MAX:MEDIAN"):
        bench.parse_lengths("100:10:50")


def test_hf_chunks_cover_rows_in_input_order():
    rng = random.Random(0)
    for _ in range(20):
        n, b = rng.randint(1, 50), rng.randint(1, 9)
        chunks = bench._hf_chunks(n, b)
        assert [i for c in chunks for i in c] == list(range(n))
        assert all(len(c) == b for c in chunks[:-1]) and 1 <= len(chunks[-1]) <= b


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
