"""Smaller ways a run went wrong quietly or loudly (issue 22, defect 8): each now refused with
one line, warned about, or written as it should be."""

import json
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    EAGER,
    FAST,
    ROOT,
    assert_one_line_error,
    prompts,
    read_stats,
    run_cli,
    run_job,
    start_cli,
    success,
    write_parquet,
)


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_job_temperature_that_is_not_finite_exits_2(tmp_path, model, value):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_job(src, tmp_path / "out", model, "--temperature", value, exit_code=2)
    assert "Traceback" not in r.stderr and "temperature" in r.stderr


def test_a_job_spec_setting_one_key_twice_exits_2(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"input: {src}\noutput: {tmp_path / 'out'}\nmax_new_tokens: 2\nmax-new-tokens: 9\n"
    )
    r = run_cli("run", spec, "--model", model, *FAST, exit_code=2)
    assert_one_line_error(r, "max_new_tokens twice", "'max-new-tokens'")


def test_a_dangling_symlink_as_output_is_named(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    r = run_job(src, link, model, exit_code=2)
    assert_one_line_error(r, "links to", "gone", "does not exist")


@pytest.mark.parametrize("delay", [0.6, 1.5])  # importing torch; reading the model or input
def test_sigint_during_start_up_exits_130(tmp_path, model, delay):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    proc = start_cli("run", src, "-o", tmp_path / "out", "--model", model, *FAST)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Aborted!" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("Error: interrupted by SIGINT")


def test_option_columns_are_named_in_one_warning(tmp_path, model, caplog):
    cols = {"prompt": prompts(2), "choice": [["a", "b"], ["c", "d"]], "stop": ["x", "y"]}
    src = write_parquet(tmp_path / "in.parquet", cols)
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 2)
    warnings = [
        r.getMessage() for r in caplog.records if "set their rows' options" in r.getMessage()
    ]
    assert len(warnings) == 1 and "'choice', 'stop'" in warnings[0]


def test_a_job_of_no_rows_writes_an_empty_part_with_the_schema(tmp_path, model):
    src = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "k": pa.array([], pa.int64())}), src
    )
    out = tmp_path / "out"
    run_job(src, out, model)
    (part,) = out.glob("part-*.parquet")
    table = pq.read_table(part)
    assert table.num_rows == 0 and {"id", "k", "generated_text", "error"} <= set(table.column_names)
    assert success(out) and read_stats(out)["rows"] == 0


def test_input_columns_named_like_output_columns_are_kept_renamed(tmp_path, model, caplog):
    gold = ["yes", "no", "yes"]
    cols = {"prompt": prompts(3), "label": gold, "scores": [1, 2, 3], "input_scores": [4, 5, 6]}
    src = write_parquet(tmp_path / "in.parquet", cols)
    out = tmp_path / "out"
    run_job(src, out, model, "--task", "score", "--choice", "yes,no")
    rows = sorted(
        pq.read_table(next(out.glob("part-*.parquet"))).to_pylist(), key=lambda r: r["id"]
    )
    assert [r["input_label"] for r in rows] == gold  # the input's labels, kept
    assert [r["input_input_scores"] for r in rows] == [1, 2, 3]  # input_scores was taken
    assert [r["input_scores"] for r in rows] == [4, 5, 6]
    assert all(
        r["label"] in ("yes", "no") and set(dict(r["scores"])) == {"yes", "no"} for r in rows
    )
    warnings = [r.getMessage() for r in caplog.records if "under another name" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'label' as 'input_label'" in warnings[0]


def test_stats_report_start_up_and_engine_time_beside_the_job_wall_time(tmp_path, model):
    """Run as its own process: its start-up (imports, config, tokenizer, input checks) is
    reported, not left out of the time the user waited."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    out = tmp_path / "out"
    proc = start_cli("run", src, "-o", out, "--model", model, *EAGER, "--max-new-tokens", 2)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    s = read_stats(out)
    assert s["startup_s"] > 0  # at least the Python start and the imports
    assert s["total_wall_s"] == pytest.approx(s["wall_s"] + s["startup_s"])
    assert s["engine_s"] == pytest.approx(s["prefill_s"] + s["decode_s"])
    assert 0 < s["engine_s"] <= s["wall_s"]
    assert "s start-up" in stdout and "engine steps" in stdout


def test_plan_takes_the_run_options(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})

    def plan(*flags, exit_code=0):
        r = run_cli(
            "plan",
            src,
            "--model",
            model,
            "--max-new-tokens",
            5,
            *flags,
            "--json",
            exit_code=exit_code,
        )
        return json.loads(r.stdout) if exit_code == 0 else r

    assert plan()["max_output_tokens"] == 20
    assert plan("--n", 3, "--temperature", 1)["max_output_tokens"] == 60  # a request per sample
    scored = plan("--task", "score", "--choice", "yes,no")
    assert scored["rows"] == 4 and scored["max_output_tokens"] == 0  # labels scored, not sampled
    assert plan("--choice", "yes,no")["rows"] == 4
    assert plan("--quantize", "int8", "--quant-backend", "quanto")["rows"] == 4
    r = plan("--lora", tmp_path / "no-adapter", exit_code=2)
    assert_one_line_error(r, "no-adapter")
    r = plan("--task", "score", exit_code=2)  # what run refuses, plan refuses
    assert_one_line_error(r, "--choice")


@pytest.mark.slow  # two processes that import torch, one quantizing
def test_torchao_is_imported_only_to_quantize_and_quietly(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    code = (
        "import sys\nfrom batchgen.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torchao imported:', 'torchao' in sys.modules)\n"
    )
    for flags, imported in [
        ((), False),
        (("--quantize", "int8", "--quant-backend", "torchao"), True),
    ]:
        args = ["run", src, "-o", tmp_path / f"out{imported}", "--model", model, *FAST, *flags]
        proc = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert f"torchao imported: {imported}" in proc.stdout
        for noise in ("Failed to load", "_C_mxfp8", "Enum subclass"):
            assert noise not in proc.stderr, proc.stderr


def test_pyproject_license_is_an_spdx_expression():
    """A license table makes setuptools warn on every install (deprecated by PEP 639)."""
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in meta["build-system"]["requires"][0]
