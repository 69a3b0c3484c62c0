"""The command line: `batchgen run | plan | slurm | merge` (main.py), their options (options.py),
YAML job specs (jobspec.py) and `batchgen plan`'s report (plan.py)."""

from batchgen.cli.main import main

__all__ = ["main"]
