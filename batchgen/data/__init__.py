"""The data layer: read inputs in batches, build prompts, write resumable outputs."""

from batchgen.data.errors import InputError, OutputBusy, OutputError, RowError
from batchgen.data.prompts import PromptBuilder
from batchgen.data.reader import InputBatch, InputFormat, InputSource, default_ids, open_input
from batchgen.data.writer import OutputDir, PartBuffer, output_schema

__all__ = [
    "InputBatch",
    "InputError",
    "InputFormat",
    "InputSource",
    "OutputBusy",
    "OutputDir",
    "OutputError",
    "PartBuffer",
    "PromptBuilder",
    "RowError",
    "default_ids",
    "open_input",
    "output_schema",
]
