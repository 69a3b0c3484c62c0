"""The `run` and `plan` commands' options, declared once each: an option's default, range and
choices come from RunConfig (job/config.py); `jobspec.build_config` merges them over a job spec's
values. Adding an option is a RunConfig field and one `_opt` line here."""

from __future__ import annotations

import dataclasses

import click

from batchgen.choices import BOUNDS, Choice
from batchgen.cli.help import per_device
from batchgen.cli.option_help import HELP
from batchgen.job.config import ENGINE_DEFAULTS, RunConfig, choice_fields

_HELP = {  # issue 31's options, vLLM's names (a column of the name overrides per row)
    "stop_token_ids": "A token id that ends its row (repeatable; kept out of the text).",
    "min_tokens": "No EOS, stop token or stop string ends a row before this many tokens.",
    "min_p": "Drop tokens less likely than min_p x the likeliest one (0 = off).",
}


def _default(name: str):
    f = next(f for f in dataclasses.fields(RunConfig) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default.value if isinstance(f.default, Choice) else f.default
    return None


def _opt(*decls: str, **kw):
    """An option whose default, range or choices come from RunConfig, so there is one source."""
    name = decls[0].lstrip("-").split("/")[0].replace("-", "_")
    if name in choice_fields():  # the values of its Choice enum
        kw["type"] = click.Choice([c.value for c in choice_fields()[name]])
    if name in BOUNDS and kw.get("type") in (int, float):  # RunConfig's range, checked by click
        b = BOUNDS[name]
        kw["type"] = (click.IntRange if kw["type"] is int else click.FloatRange)(
            min=b.low, max=b.high, min_open=b.low_open
        )
    kw.setdefault("help", HELP.get(name))
    kw.setdefault("default", _default(name))
    d = kw["default"]  # 0 is a default to show; `0 in (False,)` would hide it
    kw.setdefault("show_default", not (d is None or d is False or d == ()))
    return click.option(*decls, name, **kw)


def data_options(f):
    for o in reversed(
        [
            _opt("--input", "-i"),
            _opt("--model", "-m"),
            _opt("--prompt-column", help="Input column holding the prompt text."),
            _opt("--messages-column"),
            _opt("--template", "-t"),
            _opt("--id-column", help="Input column of unique row ids. Default: the row number."),
            _opt("--limit", type=int, help="Only the first N input rows."),
            _opt("--max-new-tokens", type=int),
            _opt("--max-prompt-len", type=int),
            _opt("--max-model-len", type=click.IntRange(min=2)),
            _opt("--truncate"),
            _opt(
                "--max-num-seqs",
                type=int,
                help=(
                    f"Sequences in flight at once (the largest decode batch); on the CPU without "
                    f"--kv-cache-tokens, only as many as the KV cache holds at full length. "
                    f"{per_device('max_num_seqs')}"
                ),
            ),
            _opt(
                "--max-num-batched-tokens",
                type=int,
                help=(
                    f"Tokens one engine step may run: decodes plus prompt chunks (long prompts are "
                    f"prefilled in chunks). {per_device('max_num_batched_tokens')}"
                ),
            ),
            _opt("--block-size", type=int),
            _opt(
                "--kv-cache-tokens",
                type=int,
                help=(
                    f"KV cache capacity in tokens. Default: on the CPU what the job needs (longest "
                    f"row x max-num-seqs); on a GPU what is left of "
                    f"{ENGINE_DEFAULTS.gpu_memory_utilization:.0%} of its memory after the "
                    "warm-up (weights, CUDA graphs and the peak activations measured)."
                ),
            ),
            _opt("--prefix-caching/--no-prefix-caching"),
            _opt("--window-rows", type=int),
        ]
    ):
        f = o(f)
    return f


def run_options(f):
    for o in reversed(
        [
            _opt("--output", "-o"),
            _opt("--passthrough", help="Comma-separated input columns to copy. Default: all."),
            _opt("--temperature", type=float),
            _opt("--top-k", type=int),
            _opt("--top-p", type=float),
            _opt("--seed", type=int),
            _opt("--stop", multiple=True, default=()),
            _opt("--stop-token-ids", type=int, multiple=True, help=_HELP["stop_token_ids"]),
            _opt("--min-tokens", type=int, help=_HELP["min_tokens"]),
            _opt("--min-p", type=float, help=_HELP["min_p"]),
            _opt("--repetition-penalty", type=float),
            _opt("--presence-penalty", type=float),
            _opt("--frequency-penalty", type=float),
            _opt("--logit-bias", metavar="JSON"),
            _opt("--ignore-eos", is_flag=True, help="Generate max_new_tokens even past EOS."),
            _opt("--task"),
            _opt("--prompt-logprobs", type=int, metavar="K"),
            _opt("--pooling"),
            _opt("--normalize/--no-normalize", default=None),
            _opt("--dimensions", type=int, metavar="N"),
            _opt("--embedding-dtype"),
            _opt("--n", type=int),
            _opt("--n-as-list", is_flag=True),
            _opt("--choice"),
            _opt("--regex"),
            _opt("--json-schema"),
            _opt("--json-any-whitespace", is_flag=True),
            _opt("--device", help="auto, cpu, cuda, cuda:N."),
            _opt("--dtype", help="auto = bfloat16 on GPU, float32 on CPU."),
            _opt("--model-impl"),
            _opt("--compile/--no-compile"),
            _opt("--compile-cache", metavar="DIR"),
            _opt("--lora"),
            _opt("--quantize", help="Weight-only quantization."),
            _opt("--quant-backend", help="Quantization library (auto picks per device)."),
            _opt("--quant-group-size", type=int),
            _opt("--rows-per-part", type=int, help="Rows per output Parquet part file."),
            _opt("--flush-seconds", type=float, help="Write a part at least this often."),
            _opt("--max-error-rate", type=click.FloatRange(0, 1)),
            _opt("--progress-seconds", type=click.FloatRange(0)),
            _opt("--with-token-ids", is_flag=True, help="Add a token_ids column."),
            _opt("--with-logprobs", is_flag=True, help="Add a logprobs column (each token's)."),
            _opt(
                "--with-stop-reason",
                is_flag=True,
                help="Add a stop_reason column: the stop string or stop token id that ended "
                "the row (as text), null for EOS or length.",
            ),
            _opt("--with-timings", is_flag=True),
            _opt("--peak-tflops", type=float),
            _opt("--peak-bandwidth-gbs", type=float),
            _opt("--output-format"),
            _opt("--overwrite", is_flag=True, help="Replace another job's results in --output."),
            _opt("--quiet", "-q", is_flag=True, help="No progress bar (for schedulers' logs)."),
            _opt("--allow-pickle", is_flag=True),
            _opt("--threads", type=int),
            _opt("--shard"),
            _opt("--workers", type=str),
            _opt("--tensor-parallel-size", "-tp", type=int),
        ]
    ):
        f = o(f)
    return f
