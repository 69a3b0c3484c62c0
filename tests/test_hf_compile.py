"""--compile on the transformers backend (model/hf/backend.py): its forward is transformers'
own, with no `hidden` seam for the compiled forward (engine/compiled_forward.py), so it runs
eagerly. It used to do so silently under --compile; now it says so in one line, and the stats
say it too (compiled_token_share 0, no graph), while a native family's job compiles and does
not warn."""

import logging

import pytest
from helpers import prompt_file, read_stats, run_cli

WARNING = "the transformers backend (--model-impl transformers) runs eagerly"


@pytest.mark.parametrize(
    "family, impl, share",
    [
        ("olmo2", "transformers", 0.0),  # no native implementation
        pytest.param("gemma2", "native", 1.0, marks=pytest.mark.slow),  # the control
    ],
)
def test_compile_on_the_transformers_backend_warns_once_and_runs_eagerly(
    family, impl, share, hf_dirs, tmp_path, caplog
):
    out = tmp_path / "out"
    flags = ("--max-new-tokens", 3, "--compile", "--compile-cache", "off")
    with caplog.at_level(logging.WARNING):
        run_cli("run", prompt_file(tmp_path, 3), "-o", out, "--model", hf_dirs(family), *flags)
    stats = read_stats(out)
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == (impl == "transformers") and all("\n" not in w for w in warned)
    assert stats["model_impl"] == impl and (stats["rows"], stats["rows_error"]) == (3, 0)
    assert stats["compiled_token_share"] == share
    if impl == "transformers":  # nothing compiled (natively, inductor's cache may hold the
        assert not stats.get("graphs_compiled")  # graphs from an earlier test: 0 too)
