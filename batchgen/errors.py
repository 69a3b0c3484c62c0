"""How batchgen fails, declared at the bottom of the package: this module imports nothing of
batchgen, so any layer can raise these and the command line maps them to exit codes.

Each error's message says what to change. Two kinds end a command:
  - `UsageError` (exit 2): the job cannot run as asked (a bad option, input, model, adapter,
    quantization scheme); raised before the model loads wherever it can be;
  - `RuntimeFailure` (exit 1): the job ran and something failed under it (a full disk, another
    run holding the output, a failed worker or tensor-parallel rank); finished rows are kept,
    a rerun resumes.
`JobInterrupted` ends a job on a signal (exit 128 + signal). `RowError` never leaves the job:
its row gets an error record and the job goes on.
"""

from __future__ import annotations

import signal


class UsageError(Exception):
    """The job cannot run as asked; the message names the fix (exit 2)."""


class RuntimeFailure(Exception):
    """The job failed while running; what is finished is kept and a rerun resumes (exit 1)."""


class ConfigError(UsageError, ValueError):
    """An option or job spec value that cannot be."""


class InputError(UsageError):
    """The job's input, output directory or prompt setup cannot be used."""


class ModelLoadError(UsageError):
    """The model directory, its config.json or its weights cannot be used."""


class RequestError(UsageError, ValueError):
    """A Python API call's prompt, candidates or parameters that cannot run."""


class QuantUnavailableError(UsageError, ValueError):
    """The quantization scheme cannot run here (library, device or dtype)."""


class OutputError(RuntimeFailure):
    """Writing the output failed at run time (e.g. a full disk); finished rows are kept and a
    rerun of the same command resumes."""


class OutputBusy(OutputError):
    """Another run holds the output directory's lock."""


class PromptTooLong(RuntimeFailure):
    """A prompt over --max-prompt-len under --truncate error."""


class WorkersFailed(RuntimeFailure):
    """A worker process of `--workers` ended with an error."""


class MergeError(RuntimeFailure):
    """Shards cannot be merged (no shards, not a directory, unfinished ones)."""


class RankFailed(RuntimeFailure):
    """A tensor-parallel rank died or failed; the whole job stops."""


class RowError(Exception):
    """One row cannot be turned into a prompt; the job records `message` for it and goes on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class JobInterrupted(Exception):
    """SIGTERM/SIGINT arrived; finished rows are written and a rerun resumes."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: finished rows are saved; "
            "run the same command again to resume"
        )
