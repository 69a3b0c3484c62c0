"""What a rerun into the same output accepts (issue 22, defect 7): a larger --limit continues
the job, a smaller one finds it complete, and adding --output-format openai to a job whose
lines ask for logprobs writes .batchgen/results.jsonl."""

import json

from helpers import (
    assert_one_line_error,
    prompts,
    read_job,
    rows_by_id,
    run_job,
    success,
    write_parquet,
)

from batchgen.data.layout import RESULTS_FILE, SUCCESS_FILE


def test_a_larger_limit_continues_the_job(tmp_path, model, caplog):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(12)})
    out = tmp_path / "out"
    run_job(src, out, model, "--limit", 4, "--max-new-tokens", 2)
    first = rows_by_id(out)
    assert sorted(first) == [0, 1, 2, 3] and success(out)

    run_job(src, out, model, "--limit", 8, "--max-new-tokens", 2)
    rows = rows_by_id(out)  # each row once: the first four kept, four more computed
    assert sorted(rows) == list(range(8)) and success(out)
    assert all(rows[i] == first[i] for i in range(4))
    assert read_job(out)["limit"] == 8

    caplog.clear()
    run_job(src, out, model, "--limit", 2, "--max-new-tokens", 2)  # already complete
    assert "complete results" in caplog.text and sorted(rows_by_id(out)) == list(range(8))
    assert read_job(out)["limit"] == 8

    run_job(src, out, model, "--max-new-tokens", 2)  # no limit: every row
    assert sorted(rows_by_id(out)) == list(range(12))
    assert read_job(out)["limit"] is None

    r = run_job(src, out, model, "--max-new-tokens", 3, exit_code=2)  # another job, still
    assert_one_line_error(r, "max_new_tokens")


def test_a_smaller_limit_does_not_leave_an_unfinished_job_half_asked(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(6)})
    out = tmp_path / "out"
    run_job(src, out, model, "--limit", 4, "--max-new-tokens", 2)
    (out / SUCCESS_FILE).unlink()  # as if killed before the end
    r = run_job(src, out, model, "--limit", 2, "--max-new-tokens", 2, exit_code=2)
    assert_one_line_error(r, "unfinished", "--limit 4")
    run_job(src, out, model, "--limit", 4, "--max-new-tokens", 2)
    assert success(out) and sorted(rows_by_id(out)) == [0, 1, 2, 3]


def test_adding_the_openai_output_to_a_job_asking_for_logprobs(tmp_path, model):
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions"}
    lines = [
        {**line, "body": {"prompt": "the quick brown fox", "max_tokens": 3, "logprobs": 1}},
        {**line, "custom_id": "d", "body": {"prompt": "the lazy dog", "max_tokens": 3}},
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    run_job(src, out, model)
    assert not (out / RESULTS_FILE).exists()
    run_job(src, out, model, "--output-format", "openai")
    got = [json.loads(x) for x in (out / RESULTS_FILE).read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["c", "d"]
    lp = got[0]["response"]["body"]["choices"][0]["logprobs"]
    assert lp["token_logprobs"] and got[1]["response"]["body"]["choices"][0]["logprobs"] is None
