"""A MoE checkpoint whose linears are stored pre-quantized (INT4: GPTQ, AWQ,
compressed-tensors pack-quantized) is not loaded yet: its experts would need the formats'
stacked expert tensors. It is refused in one line that names the format, with exit 2, before
any weight is read (the weights file here is garbage: a refusal that read it would say so)
and before the job writes anything, by `batchgen plan` too; never loaded as something else."""

import json
import shutil

import pytest
from helpers import assert_one_line_error, prompt_file, run_job, run_plan

CT_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        }
    },
}
# quantization_config -> the words its refusal names
FORMATS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}, "gptq"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, "awq"),
    "compressed-tensors": (CT_W4A16, "compressed-tensors pack-quantized"),
}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_moe_int4_checkpoint_is_refused_before_any_weight_is_read(family, fmt, hf_dirs, tmp_path):
    q, words = FORMATS[fmt]
    d = tmp_path / f"{family}-{fmt}"
    shutil.copytree(hf_dirs(family), d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "quantization_config": q}))
    (d / "model.safetensors").write_bytes(b"not a weights file")
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", d, exit_code=2)
    assert_one_line_error(r, words, "MoE", "experts", "bf16 release")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert_one_line_error(run_plan(src, d, exit_code=2), words, "MoE")
