"""What each option may be, declared once: its choices (a `Choice` enum, which RunConfig
converts to and the CLI lists) and numeric ranges (`BOUNDS`, which RunConfig checks and
the CLI gives click). Plain Python."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Choice(str, enum.Enum):
    """An option's allowed values, declared once: RunConfig converts to it, the CLI lists it.
    A member is its value wherever a string is wanted (==, f-strings, json)."""

    def __str__(self) -> str:
        return self.value


class Truncate(Choice):
    SKIP = "skip"  # the row gets an error record; the job goes on
    ERROR = "error"  # the job stops at the first too-long prompt
    LEFT = "left"  # keep the prompt's end
    RIGHT = "right"  # keep the prompt's start


class Dtype(Choice):
    AUTO = "auto"  # bfloat16 on a GPU, float32 on the CPU
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class ModelImpl(Choice):
    """Which code runs the model (vLLM's --model-impl)."""

    AUTO = "auto"  # native where batchgen has the family, else transformers
    NATIVE = "native"  # batchgen's own decoder (model/families/transformer.py)
    TRANSFORMERS = "transformers"  # transformers' modeling code, batchgen's attention


class QuantMethod(Choice):
    NONE = "none"
    INT8 = "int8"  # symmetric, one scale per output channel
    INT4 = "int4"  # affine, one scale and zero point per group of input channels
    FP8 = "fp8"  # float8 e4m3, one scale per output channel


class QuantBackend(Choice):
    AUTO = "auto"  # chosen per device, method and dtype (quant.default_backend)
    TORCHAO = "torchao"
    QUANTO = "quanto"


class Task(Choice):
    GENERATE = "generate"  # sample a completion per row (and sample)
    SCORE = "score"  # the probability of each --choice label given the prompt; nothing sampled
    PROMPT_LOGPROBS = "prompt-logprobs"  # each prompt token's logprob, perplexity; no sampling
    EMBED = "embed"  # the prompt's final hidden states pooled into an embedding; no sampling
    CLASSIFY = "classify"  # a classifier head's label probabilities (or a reward score)

    @property
    def pooled(self) -> bool:
        return self in (Task.EMBED, Task.CLASSIFY)


class PoolingChoice(Choice):
    AUTO = "auto"  # the sentence-transformers checkpoint's own (1_Pooling), else last
    LAST = "last"  # the last prompt token's final hidden state
    MEAN = "mean"  # the mean over the prompt's tokens
    CLS = "cls"  # the first token's


class EmbeddingDtype(Choice):
    FLOAT32 = "float32"
    FLOAT16 = "float16"


class OutputFormat(Choice):
    PARQUET = "parquet"  # part files, the default
    OPENAI = "openai"  # the part files, and .batchgen/results.jsonl of OpenAI batch output lines


@dataclass(frozen=True, slots=True)
class Bound:
    """The range of a numeric option: low (excluded if low_open) up to high (None: no limit)."""

    low: float
    high: float | None = None
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # NaN compares false to everything; inf is no option's value either
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"


# The most samples a row may ask for (--n, an n column, an OpenAI request's n): OpenAI's bound.
MAX_N = 128

# Numeric options' ranges, checked in RunConfig and given to click as IntRange/FloatRange, so a
# flag and a job spec value are refused alike. The sampling ones are DecodeParams' checks.
BOUNDS = {
    **dict.fromkeys(
        (
            "max_new_tokens",
            "max_prompt_len",
            "max_num_batched_tokens",
            "window_rows",
            "rows_per_part",
            "max_num_seqs",
            "block_size",
            "kv_cache_tokens",
            "limit",
            "threads",
            "tensor_parallel_size",
        ),
        Bound(1),
    ),
    "n": Bound(1, MAX_N),
    "temperature": Bound(0),
    "top_k": Bound(0, 2**63 - 1),  # an int64 tensor holds it
    "top_p": Bound(0, 1, low_open=True),
    "seed": Bound(0, 2**31 - 1),
    "repetition_penalty": Bound(0, low_open=True),
    **dict.fromkeys(("presence_penalty", "frequency_penalty"), Bound(-2, 2)),
    "flush_seconds": Bound(0),
    "peak_tflops": Bound(0, low_open=True),
    "peak_bandwidth_gbs": Bound(0, low_open=True),
}
