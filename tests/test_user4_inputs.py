"""The first hour's input traps (issue 38, items 13, 14 and 16): a malformed JSON Lines line is
its row's error naming the line (1-based), an empty input says so, a 0-row input warns, and a
missing prompt column names the fix."""

from __future__ import annotations

from helpers import (
    assert_one_line_error,
    prompts,
    read_stats,
    rows_by_id,
    run_job,
    success,
    write_parquet,
)


def test_a_malformed_jsonl_line_is_its_rows_error_naming_the_line(tmp_path, model):
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    good = [f'{{"prompt": "{p}"}}' for p in prompts(3)]
    src.write_text("\n".join([good[0], '{"prompt": ', "", good[1], "[1, 2]", good[2]]) + "\n")
    run_job(src, out, model, "--max-new-tokens", 2)
    rows = rows_by_id(out)  # ids are row numbers: blank lines are no rows
    assert len(rows) == 5 and success(out)
    assert sorted(i for i, r in rows.items() if r["error"] is None) == [0, 2, 4]
    assert rows[1]["finish_reason"] == "error"
    assert "in.jsonl line 2: not valid JSON" in rows[1]["error"]
    assert "in.jsonl line 5: a JSON list, not an object" in rows[3]["error"]
    assert rows[4]["prompt"] == prompts(3)[2]  # the rows after a bad line read as before
    assert read_stats(out)["rows_error"] == 2


def test_an_empty_input_says_so(tmp_path, model):
    for name in ("in.jsonl", "in.parquet"):
        (tmp_path / name).write_text("" if name.endswith("parquet") else "\n  \n")
        r = run_job(tmp_path / name, tmp_path / "out", model, exit_code=2)
        assert_one_line_error(r, f"input {tmp_path / name} is empty")


def test_a_zero_row_input_warns_and_completes(tmp_path, model, caplog):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)[:0]})
    run_job(src, tmp_path / "out", model)
    assert "has no rows" in caplog.text and success(tmp_path / "out")


def test_a_missing_prompt_column_names_the_fix(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"text": prompts(2), "id": [1, 2]})
    r = run_job(src, tmp_path / "out", model, exit_code=2)
    assert_one_line_error(r, "no column(s) 'prompt'", "--prompt-column text", "--template")


def test_reading_a_long_input_keeps_no_memory_per_row(tmp_path, model):
    # Item 23: a 1M-row input grew ~125 B a row after the first window; the row-number ids
    # seen were kept in a set (~60-85 B a row), though row numbers cannot repeat.
    import tracemalloc

    from batchgen.job.config import RunConfig
    from batchgen.job.open import open_job

    n, window = 12_000, 500
    src = write_parquet(
        tmp_path / "in.parquet", {"prompt": [f"the quick fox {i}" for i in range(n)]}
    )
    paths = dict(input=str(src), output=str(tmp_path / "out"), model=str(model))
    cfg = RunConfig(**paths, device="cpu", window_rows=window)
    prep = open_job(cfg).prep
    tracemalloc.start()
    try:
        held = []
        for k, _ in enumerate(prep.windows(set())):
            if k in (5, n // window - 1):
                held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    per_row = (held[1] - held[0]) / (n - 6 * window)
    assert per_row < 8, f"{per_row:.0f} bytes held a row"
