"""Audit 2, item 8: a resume under another tensor-parallel split would load other weights
(int4 keeps a layer that the split leaves too narrow at int8) and is refused, naming the layer."""

from helpers import assert_one_line_error, prompts, read_output, run_job, write_parquet
from tiny_models import save_tiny_model


def test_a_resume_on_another_tp_split_that_changes_the_weights_is_refused(tmp_path):
    # mlp.w_out's 160 inputs take groups of 32; split in two, its 80 take none and stay int8
    model = save_tiny_model("llama", tmp_path / "m", hidden_size=64, intermediate_size=160)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    out = tmp_path / "out"
    flags = ("--quantize", "int4", "--quant-backend", "torchao", "--max-new-tokens", 3)
    run_job(src, out, model, *flags, "--limit", 2, "-tp", 2)  # a job stopped after 2 rows
    r = run_job(src, out, model, *flags, exit_code=2)
    assert_one_line_error(
        r, "layers.*.mlp.w_out: int8 per channel", "group of 32", "--tensor-parallel-size"
    )
    assert read_output(out).num_rows == 2  # nothing added
