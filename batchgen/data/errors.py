"""How a job's data can fail: its whole input (stop before loading a model), one row, or the
output at run time (a full disk, another run in the same directory)."""

from __future__ import annotations


class InputError(Exception):
    """The job's input, output directory or prompt setup cannot be used.

    Raised before any model is loaded where possible; the message says what to change.
    """


class RowError(Exception):
    """One row cannot be turned into a prompt; the job records `message` for it and goes on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class OutputError(Exception):
    """Writing the output failed at run time (e.g. a full disk); finished rows are kept and a
    rerun of the same command resumes."""


class OutputBusy(OutputError):
    """Another run holds the output directory's lock."""
