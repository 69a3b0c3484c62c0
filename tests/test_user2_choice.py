"""--choice labels at a word boundary (issue 31, item 2): a label written with no leading space
also matches " label" where the prompt ends in a word, and the output is the label as written.
On the embedded model the README's command labels the sample reviews right, as the shipped
specs (jobs/label_sentiment_choice.yaml, whose labels are bare too) do."""

from __future__ import annotations

import subprocess

import pyarrow.parquet as pq
from helpers import EAGER, cli_command, rows_by_id, run_cli, run_job, write_parquet

from batchgen.job.paths import resolve_path

LABELS = ["positive", "negative", "neutral"]
TEMPLATE = "Review: {{ text }}\nSentiment:"


def _truth(limit: int) -> dict[str, str]:
    rows = pq.read_table(resolve_path("builtin:samples/reviews.parquet")).to_pylist()
    return {r["id"]: r["label"] for r in rows[:limit]}


def test_bare_labels_label_the_reviews_as_spaced_ones_do(tmp_path):
    """The README's command, bare labels from the command line, on the embedded model."""
    common = ("--id-column", "id", "--limit", 30, "--template", TEMPLATE, "--quiet")
    gen, score = tmp_path / "gen", tmp_path / "score"
    run_cli(
        "run",
        "builtin:samples/reviews.parquet",
        "-o",
        gen,
        *common,
        "--choice",
        ",".join(LABELS),
        "--max-new-tokens",
        4,
        "--with-token-ids",
    )
    run_cli(
        "run",
        "builtin:samples/reviews.parquet",
        "-o",
        score,
        *common,
        "--task",
        "score",
        "--choice",
        ",".join(LABELS),
    )
    truth = _truth(30)
    out = rows_by_id(gen)
    assert {
        i: r["generated_text"] for i, r in out.items()
    } == truth  # every label as written, right
    assert all(r["finish_reason"] == "stop" and r["error"] is None for r in out.values())
    assert {i: r["label"] for i, r in rows_by_id(score).items()} == truth


def test_tiny_model_outputs_only_labels_as_written(tmp_path, model):
    texts = [f"great product {i}" for i in range(12)]
    src = write_parquet(tmp_path / "in.parquet", {"text": texts})
    out = tmp_path / "out"
    run_job(
        src,
        out,
        model,
        "--template",
        TEMPLATE,
        "--choice",
        "positive, negative",
        "--max-new-tokens",
        16,
        "--temperature",
        1.0,
        "--seed",
        3,
    )
    rows = list(rows_by_id(out).values())
    assert all(r["finish_reason"] == "stop" for r in rows), rows
    assert {r["generated_text"] for r in rows} <= {"positive", "negative"}, rows


def test_a_prompt_ending_in_a_space_warns(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"text": ["great", "bad"]})
    cmd = cli_command(
        "run",
        src,
        "-o",
        tmp_path / "o",
        "--model",
        model,
        *EAGER,
        "--template",
        "Sentiment: {{ text }} ",
        "--choice",
        "a,b",
    )
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    lines = [x for x in err.splitlines() if "end in a space" in x]
    assert len(lines) == 1, err
