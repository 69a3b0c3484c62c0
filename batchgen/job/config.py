"""RunConfig: everything one `batchgen run` needs, from flags or a job spec file."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.choices import (
    BOUNDS,
    Choice,
    Dtype,
    EmbeddingDtype,
    ModelImpl,
    OutputFormat,
    PoolingChoice,
    QuantBackend,
    QuantMethod,
    Task,
    Truncate,
)
from batchgen.engine.config import EngineConfig
from batchgen.engine.params import logit_bias_pairs
from batchgen.errors import ConfigError
from batchgen.job.option_rules import check_combinations
from batchgen.job.paths import check_local_paths, names_results_file, resolve_path
from batchgen.job.shard import Shard, ShardError
from batchgen.job.typecheck import check_types

# The engine's defaults are EngineConfig's; a RunConfig value of None leaves them to it.
ENGINE_DEFAULTS = EngineConfig()


@dataclass(slots=True)
class RunConfig:
    input: str
    output: str
    model: str | None = None  # None: the embedded default model
    lora: str | None = None  # a PEFT LoRA adapter directory, merged into the weights at load
    # what to read
    prompt_column: str = "prompt"
    messages_column: str | None = None
    template: str | None = None  # Jinja over the row's columns, e.g. "Label: {{ text }}"
    id_column: str | None = None  # None: the global row index
    passthrough: list[str] | None = None  # input columns copied to the output; None: all
    limit: int | None = None  # only the first N rows (for trying a job out)
    shard: Shard | None = None  # "I/N": this 1/N of the rows, written to OUTPUT/shard-I-of-N/
    task: Task = Task.GENERATE
    # generation defaults; per-row columns max_new_tokens/temperature/top_p/seed override.
    # None: not given, so the model's generation_config.json, else 64, 0 (greedy), 0 (off), 1
    # (job/generation.py); open_job puts the values that apply in its Job's cfg.
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # a sampled one ends the row
    min_tokens: int = 0  # no EOS, stop token or stop string ends a row before this many
    min_p: float = 0.0  # drop tokens below min_p x the likeliest's probability (0: off)
    # vLLM's penalties (engine/params.py): 1.0 and 0.0 are off
    repetition_penalty: float = 1.0  # over the prompt and the output
    presence_penalty: float = 0.0  # over the output
    frequency_penalty: float = 0.0  # x each token's count in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # {token id: bias}; JSON text too
    ignore_eos: bool = False
    prompt_logprobs: int = 0  # task prompt-logprobs: each prompt token's top alternatives kept
    # task embed (job/embedding.py): None / auto: the sentence-transformers checkpoint's own
    pooling: PoolingChoice = PoolingChoice.AUTO
    normalize: bool | None = None  # L2-normalize each embedding
    dimensions: int | None = None  # Matryoshka: the embedding cut to its first N values
    embedding_dtype: EmbeddingDtype = EmbeddingDtype.FLOAT32
    n: int = 1  # sampled completions per row (an n column overrides), each its own record
    n_as_list: bool = False  # one record per row, its samples' fields as lists
    # structured outputs (one at most; choice/regex/json_schema columns override per row)
    choice: list[str] | None = None  # the output is one of these labels (task score: scored)
    regex: str | None = None  # the output matches this regular expression
    json_schema: str | None = None  # a JSON schema file the output must match
    json_any_whitespace: bool = False  # JSON outputs: free whitespace, not one space after , :
    # engine
    device: str = "auto"
    dtype: Dtype = Dtype.AUTO
    model_impl: ModelImpl = ModelImpl.AUTO  # auto: native where it has the family, else HF
    compile: bool | None = None  # None: on a GPU yes, on the CPU no (measured: no faster there)
    compile_cache: str | None = None  # None: $BATCHGEN_COMPILE_CACHE or ~/.cache; "off": none
    quantize: QuantMethod = QuantMethod.NONE
    quant_backend: QuantBackend = QuantBackend.AUTO
    quant_group_size: int | None = None  # int4's largest group; None: 128 (smaller where it must)
    max_prompt_len: int | None = None  # None: max_model_len less max_new_tokens
    max_model_len: int | None = None  # prompt + output; None: max_position_embeddings
    truncate: Truncate = Truncate.SKIP
    max_num_seqs: int | None = None  # sequences in flight; None: per device (EngineConfig)
    max_num_batched_tokens: int | None = None  # tokens a step runs; None: per device
    block_size: int = ENGINE_DEFAULTS.block_size  # KV cache block, in tokens
    kv_cache_tokens: int | None = None  # None: the job's need (CPU), free memory's share (GPU)
    prefix_caching: bool = ENGINE_DEFAULTS.prefix_caching  # reuse KV blocks of prefixes seen
    window_rows: int = ENGINE_DEFAULTS.read_ahead  # rows read and tokenized ahead of the engine
    # output
    rows_per_part: int = 4096
    flush_seconds: float = 60.0  # write a part at least this often, bounding work lost to a kill
    with_token_ids: bool = False
    with_logprobs: bool = False
    with_stop_reason: bool = False  # a stop_reason column: the stop string or stop token id
    with_timings: bool = False  # queued_s, ttft_s, latency_s, tpot_s columns
    output_format: OutputFormat = OutputFormat.PARQUET
    overwrite: bool = False
    quiet: bool = False
    # failures: a share of error rows above this exits 1 once everything is written (1.0: never)
    max_error_rate: float = 0.1
    progress_seconds: float = 30.0  # a progress line this often where stderr is no TTY (0: off)
    allow_pickle: bool = False
    threads: int | None = None  # CPU threads for torch; None: torch's default (all cores)
    workers: int | str = 1  # processes over shards of the input; "auto": one per visible GPU
    tensor_parallel_size: int = 1  # ranks (GPUs) one model is split over; each worker has its own
    # the hardware's peaks for MFU/MBU; None: the GPU table's, or measured on the CPU
    peak_tflops: float | None = None
    peak_bandwidth_gbs: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        try:  # a job spec's mapping, or the JSON text --logit-bias takes, as {int id: bias}
            self.logit_bias = dict(logit_bias_pairs(self.logit_bias))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_types(self)
        for key in ("input", "output"):
            if not getattr(self, key).strip():
                raise ConfigError(f"{key} is empty; pass a path")
        self.input, self.output = resolve_path(self.input), resolve_path(self.output)
        if self.model is not None:
            self.model = resolve_path(self.model)
        for key, choice in choice_fields().items():
            value = getattr(self, key)
            try:
                setattr(self, key, choice(value))
            except ValueError:
                allowed = ", ".join(c.value for c in choice)
                raise ConfigError(f"{key}: {value!r} is not one of {allowed}") from None
        check_local_paths(self.input, self.output, self.results_path is not None)
        if self.device != "auto":  # cpu, cuda, cuda:1, ...: refused here, not in a traceback
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, ValueError, TypeError):
                raise ConfigError(
                    f"device: {self.device!r} is not auto, cpu, cuda or cuda:N"
                ) from None
        for key, bound in BOUNDS.items():
            value = getattr(self, key)
            if value is not None and value not in bound:
                raise ConfigError(f"{key} must be {bound}, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:  # a prompt and a token
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise ConfigError(f"max_error_rate must be in [0, 1], got {self.max_error_rate}")
        if not self.progress_seconds >= 0:
            raise ConfigError(f"progress_seconds must be >= 0, got {self.progress_seconds}")
        if self.quant_group_size is not None:
            from batchgen.quant.scheme import INT4_GROUP_SIZES

            if self.quantize != "int4":
                raise ConfigError("quant_group_size applies to quantize int4 only")
            if self.quant_group_size not in INT4_GROUP_SIZES:
                raise ConfigError(
                    f"quant_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                    f"got {self.quant_group_size}"
                )
        try:
            self.shard = Shard.parse(self.shard) if self.shard is not None else None
        except ShardError as e:
            raise ConfigError(f"shard: {e}") from None
        if isinstance(self.workers, str) and self.workers.isdigit():
            self.workers = int(self.workers)
        if self.workers != "auto" and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise ConfigError(f"workers must be auto or an integer >= 1, got {self.workers!r}")
        if self.shard is not None and self.workers != 1:
            raise ConfigError(
                "use either shard or workers, not both (workers shard the input itself)"
            )
        check_combinations(self)

    @property
    def results_path(self) -> str | None:
        """`--output-format openai -o results.jsonl`, as vllm run-batch users write it: the
        OpenAI batch output file itself, the job's parts and state kept beside it."""
        openai = self.output_format is OutputFormat.OPENAI
        return self.output if openai and names_results_file(self.output) else None

    @property
    def output_dir(self) -> str:
        """Where this run's part files go: the output, its shard's own subdirectory, or beside
        the results file (a hidden .NAME.batchgen/ next to results_path)."""
        if self.results_path is not None:
            path = Path(self.results_path)
            return str(path.with_name(f".{path.name}.batchgen"))
        return str(Path(self.output) / self.shard.dirname) if self.shard else self.output

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "config") -> RunConfig:
        """Build from a job spec's dict; unknown keys are errors naming the allowed ones."""
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(cls.field_names())}"
            )
        missing = [k for k in ("input", "output") if values.get(k) is None]
        if missing:
            flags = {"input": "SOURCE (the first argument)", "output": "-o/--output DIR"}
            need = ", ".join(f"{k} ({flags[k]})" for k in missing)
            raise ConfigError(f"{source}: missing {need}; pass it on the command line or as a key")
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None


def read_json_schema(path: str) -> str:
    """The text of a JSON schema: inline (it starts with `{`) or a file's, checked to be JSON;
    ConfigError naming the fix."""
    import json

    if path.lstrip().startswith("{"):
        try:
            json.loads(path)
        except ValueError as e:
            raise ConfigError(f"json_schema: the inline schema is not JSON ({e})") from None
        return path
    try:
        text = Path(path).read_text(encoding="utf-8")
        json.loads(text)
    except OSError as e:
        raise ConfigError(f"json_schema: cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"json_schema: {path} is not a JSON file ({e}); pass a JSON schema"
        ) from None
    return text


@functools.cache
def choice_fields() -> dict[str, type[Choice]]:
    """RunConfig's fields typed with a Choice, and that Choice."""
    hints = typing.get_type_hints(RunConfig)
    return {k: h for k, h in hints.items() if isinstance(h, type) and issubclass(h, Choice)}
