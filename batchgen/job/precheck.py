"""The checks of a job that need neither torch nor the weights, run by the CLI before its heavy
imports: a mistyped input or model path, or an input inside the output, is refused in a
fraction of a second rather than after torch loads (2-4 s). open_job runs them again, for the
Python API and for what they resolve."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from batchgen.data import InputSource, open_input
from batchgen.errors import InputError
from batchgen.job.config import RunConfig
from batchgen.model.families.hf_config import require_model_dir


def precheck(cfg: RunConfig) -> None:
    """InputError / ConfigError / ModelLoadError for what can be seen without torch."""
    if cfg.model is not None:  # a directory with a config.json (read once, by ModelSpec)
        require_model_dir(Path(cfg.model))
    check_input_outside_output(open_input(cfg.input), cfg.output)


def check_input_outside_output(source: InputSource, output: str) -> None:
    """Refuse an input inside the output directory (or the directory itself): a run replaces
    the files there and --overwrite deletes them, an input's too, before it is read."""
    out = Path(os.path.realpath(os.path.expanduser(output)))
    paths = [*source.files, *([] if glob.has_magic(source.path) else [source.path])]
    for p in paths:
        if Path(os.path.realpath(p)).is_relative_to(out):
            raise InputError(
                f"input {p} is inside the output directory {output}, whose files a run replaces "
                "(and --overwrite deletes); pass another -o, or move the input out of it"
            )
