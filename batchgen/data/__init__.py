"""The data layer: read inputs in batches, build prompts, write resumable outputs."""

from batchgen.data.errors import InputError, RowError
from batchgen.data.prompts import PromptBuilder
from batchgen.data.reader import InputBatch, InputFormat, InputSource, default_ids, open_input
from batchgen.data.writer import OutputDir, PartBuffer, output_schema

__all__ = [
    "InputBatch",
    "InputError",
    "InputFormat",
    "InputSource",
    "OutputDir",
    "PartBuffer",
    "PromptBuilder",
    "RowError",
    "default_ids",
    "open_input",
    "output_schema",
]
