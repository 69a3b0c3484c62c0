"""The warm-up (issue 31: "warm-up counts as prefill"): before the first row, every engine runs
a full-size prefill and, eager, a full decode once, so the process's one-off costs land in
`warmup_s`, not in the first rows' steps and TTFT; nothing of it counts as a row's work."""

import pyarrow.parquet as pq
from helpers import FAST, prompts, read_stats, run_job, write_parquet

from batchgen.engine.sequence import Request, SamplingParams
from batchgen.llm import LLM


def test_the_first_report_is_the_warm_up_and_holds_no_row(model):
    llm = LLM(model, dtype="float32", device="cpu", compile=False)
    reports = llm.engine.generate(
        Request(i, [5, 6, 7], SamplingParams(max_new_tokens=2)) for i in range(3)
    )
    first = next(reports)
    assert first.warmup_seconds > 0
    assert (first.prompt_tokens, first.decode_rows, first.finished) == (0, 0, [])
    rest = list(reports)
    assert sum(len(r.finished) for r in rest) == 3
    assert all(r.warmup_seconds == 0 for r in rest)


def test_stats_keep_the_warm_up_apart_from_prefill(model, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(8)})
    out = tmp_path / "out"
    run_job(src, out, model, *FAST, "--max-new-tokens", 4)
    s = read_stats(out)
    assert s["warmup_s"] > 0
    assert s["computed_prompt_tokens"] == s["prompt_tokens"]  # no warm-up token among them
    assert pq.read_table(out / ".batchgen" / "steps").num_rows == s["steps"]
