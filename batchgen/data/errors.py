"""The two ways input can fail: the whole job's input (stop before loading a model) or one row."""

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
