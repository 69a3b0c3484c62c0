"""Pre-quantized checkpoints batchgen does not load: each format family users download that is
not loaded as its format says (test_quant_compressed_tensors.py) is refused before any weight
is read, in one line naming the format and the fix (exit 2); never run as a wrong model (issue
39: compressed-tensors FP8 weights read without their scales ran and exited 0)."""

import pytest
from helpers import assert_one_line_error, prompt_file, run_cli, run_job, run_plan
from quant_checkpoints import FORMATS, declare_format

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.loader import load_model

# family -> words the refusal names
REFUSED = {
    "ct-fp8-kv-cache": ("compressed-tensors float-quantized", "8-bit float"),
    "ct-w3a16": ("compressed-tensors pack-quantized", "3-bit int", "per group"),
    "modelopt-nvfp4": ("modelopt", "NVFP4"),
    "gptq-3bit": ("gptq", "3-bit"),
    "awq-gemv": ("awq", "4-bit", "gemv"),
    "bitsandbytes": ("bitsandbytes",),
    "undeclared-fp8": ("weight_scale (F32)", "declares no quantization_config"),
}
assert set(REFUSED) == set(FORMATS)


@pytest.fixture(scope="module")
def quantized(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {f: declare_format(tiny_dirs["llama"], root / f, f) for f in FORMATS}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_formats_are_refused_in_one_line_before_loading(family, quantized, tmp_path):
    src = prompt_file(tmp_path, 2)
    r = run_job(src, tmp_path / "out", quantized[family], exit_code=2)
    assert_one_line_error(r, *REFUSED[family], "--quantize")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert_one_line_error(run_plan(src, quantized[family], exit_code=2), *REFUSED[family])
    with pytest.raises(ModelLoadError, match="pre-quantized|quantized tensors"):
        load_model(quantized[family])


@pytest.mark.parametrize("family", ["undeclared-fp8", "modelopt-nvfp4"])
def test_the_transformers_backend_refuses_them_too(family, quantized, tmp_path):
    """A format transformers' config check does not see (no quantization_config)."""
    src = prompt_file(tmp_path, 2)
    flags = ("--model-impl", "transformers")
    r = run_job(src, tmp_path / "out", quantized[family], *flags, exit_code=2)
    assert_one_line_error(r, *REFUSED[family])


def test_a_float_checkpoint_still_loads(tiny_dirs, tmp_path):
    run_cli("plan", prompt_file(tmp_path, 2), "--model", tiny_dirs["llama"])
