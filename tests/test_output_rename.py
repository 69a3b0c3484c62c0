"""The text column's rename (`text` -> `generated_text`, issue 31): an input's `text` column
keeps its name, and a rerun over an output an earlier batchgen left half done rewrites its
parts under today's names, so the finished output is one dataset with one schema."""

import pandas as pd
import pyarrow.parquet as pq
from helpers import FAST, prompts, read_output, rows_by_id, run_job, success, write_parquet

from batchgen.data.layout import SUCCESS_FILE

N = 12
FLAGS = (*FAST, "--max-new-tokens", 6, "--rows-per-part", 4, "-t", "Say: {{ text }}")


def _to_legacy(out) -> None:
    """Make `out` what batchgen before the rename left after it was killed: parts naming the
    text `text` and the input's `text` `input_text`; the last part and _SUCCESS gone."""
    parts = sorted(out.glob("part-*.parquet"))
    for part in parts:
        table = pq.read_table(part)
        old = {"text": "input_text", "generated_text": "text"}
        pq.write_table(table.rename_columns([old.get(c, c) for c in table.column_names]), part)
    parts[-1].unlink()
    (out / SUCCESS_FILE).unlink()


def test_a_rerun_over_a_legacy_output_renames_its_parts(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"text": prompts(N), "k": list(range(N))})
    clean, out = tmp_path / "clean", tmp_path / "out"
    run_job(src, clean, model, *FLAGS)
    run_job(src, out, model, *FLAGS)
    _to_legacy(out)
    assert "input_text" in read_output(out).column_names  # the setup made a legacy output

    run_job(src, out, model, *FLAGS)
    assert success(out)
    for part in out.glob("part-*.parquet"):  # every part, old and new, under today's names
        names = pq.read_schema(part).names
        assert names[:3] == ["id", "text", "k"] and "generated_text" in names, names
    frame = pd.read_parquet(out)
    assert sorted(frame["id"]) == list(range(N))  # each row once
    want = rows_by_id(clean)
    for i, r in rows_by_id(out).items():
        assert (r["text"], r["generated_text"]) == (want[i]["text"], want[i]["generated_text"])


def test_a_score_jobs_input_text_column_is_not_taken_for_a_legacy_text(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4), "text": prompts(4)})
    out = tmp_path / "out"
    flags = (*FAST, "--task", "score", "--choice", " yes, no", "--rows-per-part", 2)
    run_job(src, out, model, *flags)
    first = sorted(out.glob("part-*.parquet"))
    first[-1].unlink()
    (out / SUCCESS_FILE).unlink()
    run_job(src, out, model, *flags)
    for part in out.glob("part-*.parquet"):
        names = pq.read_schema(part).names
        assert "text" in names and "generated_text" not in names, names
    assert sorted(read_output(out).column("id").to_pylist()) == [0, 1, 2, 3]
