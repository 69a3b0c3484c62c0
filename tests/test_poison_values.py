"""Issue 38 item 21: poison rows and values are refused in one line or fail their own row,
never crash a job at its first step or run to exit 0 with garbage: an out-of-vocabulary stop
token id under min_tokens, integers past int64, an oversized logit_bias, a malformed
generation_config eos_token_id, a NaN rms_norm_eps or a negative rope_theta."""

from __future__ import annotations

import json
import logging
import shutil

import pyarrow as pa
import pyarrow.json as pj
import pytest
from helpers import assert_one_line_error, read_output, run_job, write_jsonl

from batchgen.engine.params import MAX_LOGIT_BIAS_TOKENS, DecodeParams, logit_bias_pairs
from batchgen.errors import ModelLoadError
from batchgen.job.bias_column import compact_bias_column
from batchgen.job.generation import model_defaults
from batchgen.job.model_spec import ModelSpec

PROMPT = "The quick brown fox"


def _edited(model, tmp_path, name: str, **values) -> str:
    """A copy of the tiny model with values set in its `name` JSON file."""
    d = tmp_path / "model"
    shutil.copytree(model, d)
    path = d / name
    cfg = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**cfg, **values}))
    return d


def test_an_out_of_vocabulary_stop_id_under_min_tokens_is_a_row_error(model, tmp_path):
    rows = [
        {"id": 0, "prompt": PROMPT, "stop_token_ids": [10**6]},
        {"id": 1, "prompt": PROMPT, "stop_token_ids": []},
    ]
    out = tmp_path / "out"
    run_job(write_jsonl(tmp_path / "in.jsonl", rows), out, model, "--min-tokens", 2)
    got = {r["id"]: r for r in read_output(out).to_pylist()}
    assert "stop_token_ids token id 1000000 is not in the model's vocabulary" in got[0]["error"]
    assert got[1]["error"] is None and got[1]["generated_text"]


def test_top_k_past_int64_is_one_line(model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt": PROMPT}])
    r = run_job(src, tmp_path / "out", model, "--top-k", 10**20, exit_code=2)
    assert_one_line_error(r, "top-k")


def test_generation_config_top_k_past_int64_is_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="batchgen.job.generation"):
        assert model_defaults({"top_k": 10**20, "top_p": 0.5}) == {"top_p": 0.5}
    assert "top_k" in caplog.text


def test_logit_bias_has_a_size_bound():
    fine = {str(t): 1 for t in range(MAX_LOGIT_BIAS_TOKENS)}
    assert len(logit_bias_pairs(json.dumps(fine))) == MAX_LOGIT_BIAS_TOKENS
    big = {str(t): 1 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)}
    for value in (big, json.dumps(big), json.dumps(big) + " " * 10**6):
        with pytest.raises(ValueError, match="logit_bias"):
            logit_bias_pairs(value)
    with pytest.raises(ValueError, match=f"at most {MAX_LOGIT_BIAS_TOKENS}"):
        DecodeParams(logit_bias=tuple((t, 1.0) for t in range(1000)))
    # a struct column's row: every row's keys, None where another row set them, not counted
    struct_row = {**{str(t): None for t in range(5000)}, "7": 2.0}
    assert logit_bias_pairs(struct_row) == ((7, 2.0),)


@pytest.mark.parametrize("eos", [2.5, [[2]], "</s>", [], True])
def test_a_malformed_eos_token_id_is_refused(model, tmp_path, eos):
    d = _edited(model, tmp_path, "generation_config.json", eos_token_id=eos)
    with pytest.raises(ModelLoadError, match="generation_config.json: eos_token_id"):
        ModelSpec.resolve(d, device="cpu")


def test_a_malformed_eos_token_id_is_one_line_on_the_cli(model, tmp_path):
    d = _edited(model, tmp_path, "generation_config.json", eos_token_id="</s>")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt": PROMPT}])
    assert_one_line_error(run_job(src, tmp_path / "out", d, exit_code=2), "eos_token_id")


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"rms_norm_eps": float("nan")}, "norm_eps"),
        ({"rms_norm_eps": -1e-6}, "norm_eps"),
        ({"rope_parameters": {"rope_theta": -1e4, "rope_type": "default"}}, "rope_theta"),
    ],
)
def test_a_poisoned_config_value_is_refused(model, tmp_path, values, says):
    d = _edited(model, tmp_path, "config.json", **values)
    with pytest.raises(ModelLoadError, match=says):
        ModelSpec.resolve(d, device="cpu")


def test_a_struct_logit_bias_column_keeps_only_each_row_s_entries(tmp_path):
    """pyarrow reads JSON objects as a struct of every row's keys: 2000 rows each biasing its
    own token made 2000 x 2000 dict entries; compacted, each row holds its own."""
    rows = [{"id": i, "logit_bias": {str(i): 1.5}} for i in range(2000)] + [{"id": 2000}]
    batch = pj.read_json(write_jsonl(tmp_path / "in.jsonl", rows)).to_batches()[0]
    assert pa.types.is_struct(batch.schema.field("logit_bias").type)  # what the reader gives
    got = compact_bias_column(batch).column("logit_bias").to_pylist()
    assert got[:2000] == [json.dumps({str(i): 1.5}) for i in range(2000)] and got[2000] is None
    assert logit_bias_pairs(got[7]) == ((7, 1.5),)


def test_rows_bias_their_own_tokens_from_a_jsonl_object_column(model, tmp_path):
    rows = [{"id": i, "prompt": PROMPT, "logit_bias": {str(t): 100}} for i, t in enumerate([7, 9])]
    out = tmp_path / "out"
    run_job(write_jsonl(tmp_path / "in.jsonl", rows), out, model, "--with-token-ids")
    got = {r["id"]: r for r in read_output(out).to_pylist()}
    assert set(got[0]["token_ids"]) == {7} and set(got[1]["token_ids"]) == {9}
    assert got[1]["logit_bias"] == '{"9": 100}'  # copied as the row's own entries
