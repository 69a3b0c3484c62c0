"""The data layer: read inputs in batches, build prompts, write resumable outputs."""

from batchgen.data.prompts import PromptBuilder
from batchgen.data.reader import open_input
from batchgen.data.records import PartBuffer, output_schema
from batchgen.data.source import InputBatch, InputFormat, InputSource, default_ids
from batchgen.data.writer import OutputDir

__all__ = [
    "InputBatch",
    "InputFormat",
    "InputSource",
    "OutputDir",
    "PartBuffer",
    "PromptBuilder",
    "default_ids",
    "open_input",
    "output_schema",
]
