"""Audit 2, item 15: the report's compute ceiling charges the LM head only for rows whose
logits are used (every row of a decode step, one of a prompt's), as the FLOPs behind MFU do."""

import json

import pytest
from helpers import prompts, read_stats, run_cli, run_job, write_parquet

from batchgen.report import plots
from batchgen.report.load import load
from batchgen.stats.roofline import compute_ceiling_s

# per token: 2e9 through the decoder's matrices, 1e9 more where it goes through the LM head
STATS = {"peak_flops": 1e12, "model_flops_per_token": 3e9, "head_flops_per_row": 1e9}


def test_the_ceiling_in_numbers():
    assert compute_ceiling_s(STATS, 1000, 1000) == pytest.approx(3.0)  # 1000 decode rows
    assert compute_ceiling_s(STATS, 1000, 1) == pytest.approx(2.001)  # a 1000-token prompt
    old = {k: v for k, v in STATS.items() if k != "head_flops_per_row"}  # an older stats.json
    assert compute_ceiling_s(old, 1000, 1) == pytest.approx(3.0)
    assert compute_ceiling_s({**STATS, "peak_flops": None}, 1, 1) is None


def test_a_reports_prefill_ceiling_leaves_the_head_out(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 3, "--peak-tflops", 1, "--peak-bandwidth-gbs", 10)
    cfg = json.loads((model / "config.json").read_text())
    stats = read_stats(out)
    head = 2 * cfg["vocab_size"] * cfg["hidden_size"]
    assert stats["head_flops_per_row"] == head
    run_cli("report", out)  # the page draws
    data = load(out)
    ax = plots.roofline(data.steps, data.stats).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    prefill = lines["compute ceiling, prefill (one row's LM head)"]
    x, y = prefill.get_xdata()[-1], prefill.get_ydata()[-1]
    per_token = stats["model_flops_per_token"]
    assert y == pytest.approx(((per_token - head) * x + head) / 1e12)
    decode = lines["compute ceiling, decode (FLOPs / peak)"]
    assert decode.get_ydata()[-1] == pytest.approx(per_token * x / 1e12)
