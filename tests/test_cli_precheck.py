"""A wrong input or model path fails before torch is imported (issue 31: each such check
took about 4 s, as torch loaded first). torch is made unimportable in the CLI's process: a
check that ran after the import would end in an ImportError instead of its one line."""

import subprocess
import sys

import pytest
from helpers import ROOT, assert_one_line_error, prompts, write_parquet

NO_TORCH = "import sys; sys.modules['torch'] = None; from batchgen.cli.main import main; main()"


def _cli_without_torch(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", NO_TORCH, "run", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing input", ["does not exist"]),
        ("missing model", ["not a model directory", "save_pretrained"]),
        ("input inside output", ["inside the output directory"]),
    ],
)
def test_path_mistakes_are_refused_before_torch_loads(tmp_path, case, words):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    args = {
        "missing input": (tmp_path / "nope.parquet", "-o", tmp_path / "out"),
        "missing model": (src, "-o", tmp_path / "out", "--model", tmp_path),
        "input inside output": (src, "-o", tmp_path),
    }[case]
    r = _cli_without_torch(*args)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr, *words)
