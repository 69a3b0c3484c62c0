"""The shipped job specs, their documentation, and the Makefile pipeline that runs them."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from helpers import prompts, run_cli, run_job, write_parquet

from batchgen.cli import main
from batchgen.job.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))


def test_there_are_labeling_and_generation_jobs():
    names = {p.name for p in JOBS}
    assert {"label_sentiment.yaml", "summarize.yaml"} <= names


@pytest.mark.parametrize("spec", JOBS, ids=lambda p: p.name)
def test_shipped_jobs_are_valid_on_the_embedded_default(spec):
    values = yaml.safe_load(spec.read_text())
    assert "model" not in values and values["output"].startswith("out/")
    assert values["input"].startswith("builtin:samples/")
    # `slurm --dry-run` builds the RunConfig exactly as `run` does: every key checked
    r = CliRunner().invoke(main, ["slurm", "--dry-run", str(spec), "--shards", "2"])
    assert r.exit_code == 0, r.output


def _run_spec(name: str, out) -> list[dict]:
    """The first 12 rows of a shipped job spec, eagerly; its output rows."""
    r = CliRunner().invoke(
        main,
        ["run", str(ROOT / "jobs" / name), "--limit", "12", "--no-compile", "-o", str(out), "-q"],
    )
    assert r.exit_code == 0, r.output
    return pq.read_table(out).to_pylist()


def test_label_job_runs_on_the_embedded_default(tmp_path):
    rows = _run_spec("label_sentiment.yaml", tmp_path / "out")
    assert len(rows) == 12 and all(r["id"].startswith("r") for r in rows)
    assert {r["generated_text"].strip() for r in rows} <= {"positive", "negative", "neutral"}
    assert (
        sum(r["generated_text"].strip() == r["label"] for r in rows) >= 6
    )  # the demo model is ~78% right


@pytest.mark.parametrize(
    ("spec", "labels"),
    [
        ("label_sentiment_choice.yaml", {"positive", "negative", "neutral"}),
        ("label_topic.yaml", {"sports", "tech", "food", "travel"}),
    ],
)
def test_choice_label_jobs_write_the_labels_as_documented(tmp_path, spec, labels):
    """The README: the output is the label as written, without the model's leading space."""
    rows = _run_spec(spec, tmp_path / "out")
    assert len(rows) == 12
    assert {r["generated_text"] for r in rows} <= labels
    assert all(r["finish_reason"] == "stop" for r in rows)
    assert sum(r["generated_text"] == r["label"] for r in rows) >= 11  # measured: 100%


def test_score_label_job_gives_probabilities_of_the_labels(tmp_path):
    rows = _run_spec("label_sentiment_score.yaml", tmp_path / "out")
    truth = {
        r["id"]: r["label"]
        for r in pq.read_table(ROOT / "batchgen/assets/samples/reviews.parquet").to_pylist()
    }
    assert len(rows) == 12 and all(r["error"] is None for r in rows)
    for r in rows:
        probs = dict(r["scores"])
        assert list(probs) == ["positive", "negative", "neutral"]
        assert sum(probs.values()) == pytest.approx(1.0) and r["label"] == max(probs, key=probs.get)
    assert sum(r["label"] == truth[r["id"]] for r in rows) >= 11  # measured: 200/200


def test_docs_list_every_key():
    text = (ROOT / "docs" / "jobs.md").read_text()
    keys = [f.name for f in dataclasses.fields(RunConfig)]
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"docs/jobs.md does not document {missing}"


def test_pipeline_makefile_parses():
    r = subprocess.run(
        ["make", "-n", "-B", "label", "summarize"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "batchgen merge out/label/run" in r.stdout
    assert "pipeline.py report label out/label/run" in r.stdout


def test_pipeline_report_gives_rates_over_the_time_it_prints(model, tmp_path):
    """`make label`'s last step: rows/s is rows over the seconds printed beside it (it printed
    the slowest shard's wall time beside rates over both shards' intervals)."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(8), "label": ["a"] * 8})
    out = tmp_path / "run"
    for i in range(2):  # one after the other: their intervals add up
        run_job(src, out, model, "--shard", f"{i}/2", "--max-new-tokens", 2)
    run_cli("merge", out)
    r = subprocess.run(
        [sys.executable, ROOT / "scripts" / "pipeline.py", "report", "label", out],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, rate = re.search(r"in ([\d.]+) s .*: ([\d.]+) rows/s", r.stdout).groups()
    assert float(rate) == pytest.approx(8 / float(seconds), rel=0.05, abs=0.1), r.stdout


def test_docs_say_what_the_makefile_and_the_openai_reader_do():
    """docs/jobs.md: `make label`'s spec is the one mk/pipeline.mk runs, PIPELINE_FLAGS is not
    said to hold a flag the Makefile leaves out, and the OpenAI body fields it calls unmapped
    are not ones the reader maps."""
    from batchgen.data.openai_batch import MAPPED_FIELDS

    docs, mk = (ROOT / "docs" / "jobs.md").read_text(), (ROOT / "mk" / "pipeline.mk").read_text()
    spec = re.search(r"\$\(BIN\)/batchgen run (jobs/\S+)", mk)[1]
    bullet = re.search(r"- `make label`:(.*?)\n- ", docs, re.S)[1]
    assert re.findall(r"jobs/[\w.]+\.yaml", bullet) == [spec]
    assert "--no-compile" not in mk and "pipelines pass `--no-compile`" not in docs
    unmapped = re.search(r"Body fields with no mapping \((.*?)\)", docs)[1]
    assert not set(re.findall(r"`(\w+)`", unmapped)) & MAPPED_FIELDS
