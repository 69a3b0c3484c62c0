"""`run --help` and `plan --help` in sections: input, output, model, sampling, constraints,
engine, scale-out, the options a job nearly always sets first in each; `run`'s exit codes. 55
options in one list put -o twentieth; in sections it is on the first screen. An option no
section names lands in "Other options" (tests/test_user3_help.py keeps that to --help and a
command's own)."""

from __future__ import annotations

import click

from batchgen.engine.config import EngineConfig

# `run --help`'s epilog
EXIT_CODES = """\b
Exit codes:
  0    done (or already complete)
  1    a runtime failure: a full disk, another run holding OUTPUT, a too-long prompt under
       --truncate error, a failed worker; what is finished is kept, rerun to resume;
       or more error rows than --max-error-rate (every row written)
  2    a usage or input error, reported before the model loads where it can be: a bad flag
       or job spec value, an unreadable input, model or config.json, another job's OUTPUT
  128+N  stopped by signal N (143: SIGTERM, 130: SIGINT); finished rows are saved, rerun to resume
"""

SECTIONS: dict[str, tuple[str, ...]] = {
    "Input": (
        "input",
        "template",
        "prompt_column",
        "messages_column",
        "id_column",
        "limit",
    ),
    "Output": (
        "output",
        "output_format",
        "overwrite",
        "passthrough",
        "with_token_ids",
        "with_logprobs",
        "with_stop_reason",
        "with_timings",
        "max_error_rate",
        "quiet",
        "progress_seconds",
        "rows_per_part",
        "flush_seconds",
    ),
    "Model": (
        "model",
        "max_model_len",
        "max_prompt_len",
        "truncate",
        "dtype",
        "device",
        "model_impl",
        "lora",
        "quantize",
        "quant_backend",
        "quant_group_size",
        "allow_pickle",
    ),
    "Sampling": (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "min_tokens",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "n",
        "n_as_list",
        "ignore_eos",
        "task",
        "prompt_logprobs",
    ),
    "Embeddings": ("pooling", "normalize", "dimensions", "embedding_dtype"),
    "Constraints": ("choice", "regex", "json_schema", "json_any_whitespace"),
    "Engine": (
        "compile",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_tokens",
        "prefix_caching",
        "block_size",
        "window_rows",
        "compile_cache",
        "threads",
        "peak_tflops",
        "peak_bandwidth_gbs",
    ),
    "Scale-out": ("workers", "tensor_parallel_size", "shard", "dry_run"),
}


class SectionedCommand(click.Command):
    """A command whose --help lists its options by SECTIONS, in their order there."""

    def __init__(self, *args, **kwargs) -> None:
        # -h as well, also in a context made for the command alone (click caches the help
        # option on the command the first time a context asks for it)
        kwargs.setdefault("context_settings", {}).setdefault("help_option_names", ["-h", "--help"])
        super().__init__(*args, **kwargs)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        records = {name: r for name, r in records.items() if r is not None}
        for title, names in SECTIONS.items():
            rows = [records.pop(n) for n in names if n in records]
            if rows:
                with formatter.section(f"{title} options"):
                    formatter.write_dl(rows)
        if records:  # --help, and a command's own (plan --json)
            with formatter.section("Other options"):
                formatter.write_dl(list(records.values()))


def per_device(name: str) -> str:
    """EngineConfig's default of a knob whose RunConfig default is None, for its help."""
    cpu, gpu = (getattr(EngineConfig.for_device(d), name) for d in ("cpu", "cuda"))
    text = f"Default: {cpu}" if cpu == gpu else f"Default: {cpu} on CPU, {gpu} on GPU"
    compiled = getattr(EngineConfig.for_device("cpu", compiled=True), name)
    return text + (f"; {compiled} on CPU with --compile." if compiled != cpu else ".")
