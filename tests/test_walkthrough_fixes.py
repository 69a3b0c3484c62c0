"""What the fresh-clone walkthrough (docs/walkthrough.md) found besides the README: plan's
length histogram counted samples, the API printed `FinishReason.STOP` where vLLM prints
`stop`, and a rerun of a finished job printed a table of zeros."""

import json

from helpers import FAST, prompts, run_job, run_plan, write_parquet

from batchgen.api.sampling import SamplingParams
from batchgen.llm import LLM


def test_plans_histogram_counts_prompts_not_samples(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(6)})
    plan = json.loads(run_plan(src, model, "--n", 4, "--temperature", 1, "--json").stdout)
    assert (plan["prompts"], plan["rows"]) == (6, 24)
    assert sum(plan["length_histogram"].values()) == 6


def test_finish_reason_prints_as_vllms_does(model):
    out = LLM(model, device="cpu").generate("hello", SamplingParams(temperature=0, max_tokens=2))[0]
    assert str(out.outputs[0].finish_reason) in ("stop", "length")
    assert f"{out.outputs[0].finish_reason}" == out.outputs[0].finish_reason.value


def test_a_rerun_of_a_finished_job_says_so_in_one_line(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    run_job(src, tmp_path / "out", model, *FAST)
    again = run_job(src, tmp_path / "out", model, *FAST).stdout
    assert again.strip().endswith("all 3 rows were done before"), again
    assert "MiB" not in again  # no table of zeros
