"""RunConfig: everything one `batchgen run` needs, from flags or a job spec file."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.shard import Shard, ShardError


class ConfigError(ValueError):
    pass


class Truncate(str, enum.Enum):
    SKIP = "skip"  # the row gets an error record; the job goes on
    ERROR = "error"  # the job stops at the first too-long prompt
    LEFT = "left"  # keep the prompt's end
    RIGHT = "right"  # keep the prompt's start


_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "quantize": ("none", "int8", "int4", "fp8"),
    "quant_backend": ("auto", "torchao", "quanto"),
    "truncate": tuple(t.value for t in Truncate),
}


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
    # generation defaults; per-row columns max_new_tokens/temperature/top_p/seed override
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # engine
    device: str = "auto"
    dtype: str = "auto"
    compile: bool | None = None  # None: on a GPU yes, on the CPU no (measured: no faster there)
    quantize: str = "none"
    quant_backend: str = "auto"
    max_prompt_len: int = 1024
    truncate: Truncate = Truncate.SKIP
    max_num_seqs: int | None = None  # sequences in flight; None: 64 on CPU, 256 on GPU
    max_num_batched_tokens: int | None = None  # tokens a step runs; None: 2048 CPU, 8192 GPU
    block_size: int = 16  # KV cache block, in tokens
    kv_cache_tokens: int | None = None  # None: the job's need (CPU), 80% of free memory (GPU)
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    window_rows: int = 8192  # rows read and tokenized ahead of the engine (its admission window)
    # output
    rows_per_part: int = 4096
    flush_seconds: float = 60.0  # write a part at least this often, bounding work lost to a kill
    with_token_ids: bool = False
    with_logprobs: bool = False
    overwrite: bool = False
    quiet: bool = False
    allow_pickle: bool = False
    threads: int | None = None  # CPU threads for torch; None: torch's default (all cores)
    workers: int | str = 1  # processes over shards of the input; "auto": one per visible GPU

    def __post_init__(self) -> None:
        for key, allowed in _CHOICES.items():
            value = getattr(self, key)
            value = value.value if isinstance(value, enum.Enum) else value
            if value not in allowed:
                raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
        self.truncate = Truncate(self.truncate)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        positive = (
            "max_new_tokens",
            "max_prompt_len",
            "block_size",
            "window_rows",
            "rows_per_part",
        )
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise ConfigError(f"seed must be an integer in [0, 2**31), got {self.seed!r}")
        for key in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_tokens",
            "limit",
            "threads",
        ):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
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
        if self.messages_column and self.template:
            raise ConfigError("use either messages_column or template, not both")

    @property
    def output_dir(self) -> str:
        """Where this run's part files go: the output, or its shard's own subdirectory."""
        return str(Path(self.output) / self.shard.dirname) if self.shard else self.output

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "config") -> RunConfig:
        """Build from a job spec's dict; unknown keys are errors naming the allowed ones."""
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(cls.keys())}"
            )
        missing = [k for k in ("input", "output") if values.get(k) is None]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)}")
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs the same job: a rerun with a different one is refused."""
        skip = {"overwrite", "quiet", "rows_per_part", "flush_seconds", "window_rows", "max_num_seqs",
                "max_num_batched_tokens", "block_size", "kv_cache_tokens", "prefix_caching",
                "compile", "workers", "threads"}  # fmt: skip
        out = {k: getattr(self, k) for k in self.keys() if k not in skip}
        out["input"] = str(Path(self.input).resolve()) if "*" not in self.input else self.input
        out["output"] = str(Path(self.output).resolve())
        out["truncate"] = self.truncate.value
        if self.lora is None:  # runs without an adapter keep the fingerprint they had before
            del out["lora"]
        else:  # the adapter's content, too: retraining it in place makes another job
            from batchgen.model.lora import adapter_sha256

            out["lora"] = {
                "path": str(Path(self.lora).resolve()),
                "sha256": adapter_sha256(self.lora),
            }
        # Unsharded runs keep the fingerprint they had before shards existed.
        if self.shard:
            out["shard"] = str(self.shard)
        else:
            del out["shard"]
        return out
