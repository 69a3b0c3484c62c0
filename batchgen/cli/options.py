"""The `run` and `plan` commands' options, declared once each: an option's default, range and
choices come from RunConfig (config.py); `jobspec.build_config` merges them over a job spec's
values. Adding an option is a RunConfig field and one `_opt` line here."""

from __future__ import annotations

import dataclasses

import click

from batchgen.choices import BOUNDS, Choice
from batchgen.cli.help import per_device
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
    kw.setdefault("default", _default(name))
    d = kw["default"]  # 0 is a default to show; `0 in (False,)` would hide it
    kw.setdefault("show_default", not (d is None or d is False or d == ()))
    return click.option(*decls, name, **kw)


def data_options(f):
    for o in reversed(
        [
            _opt(
                "--input",
                "-i",
                help="Input data; overrides a job spec's input (builtin:samples/... for the shipped samples).",
            ),
            _opt(
                "--model",
                "-m",
                help="Local model directory (config.json + *.safetensors). Default: the embedded demo model.",
            ),
            _opt("--prompt-column", help="Input column holding the prompt text."),
            _opt(
                "--messages-column",
                help="Input column of chat messages [{role, content}], rendered with the tokenizer's chat template.",
            ),
            _opt(
                "--template",
                "-t",
                help=(
                    "Jinja prompt template over input columns, e.g. "
                    '"Label the sentiment of: {{ text }}". On the command line \\n, \\t and \\\\ '
                    "are read as a newline, a tab and a backslash."
                ),
            ),
            _opt("--id-column", help="Input column of unique row ids. Default: the row number."),
            _opt("--limit", type=int, help="Only the first N input rows."),
            _opt(
                "--max-new-tokens",
                type=int,
                help="Tokens to generate per row (a max_new_tokens column overrides per row). Default: the model's generation_config.json max_new_tokens, else 64.",
            ),
            _opt(
                "--max-prompt-len",
                type=int,
                help="Longest prompt in tokens. Default: --max-model-len less --max-new-tokens.",
            ),
            _opt(
                "--max-model-len",
                type=click.IntRange(min=2),
                help="Most tokens of a row, prompt and output (vLLM's name). Default: the model's max_position_embeddings.",
            ),
            _opt(
                "--truncate",
                help="Prompts over the limit (--max-prompt-len, --max-model-len): skip (error record), error (stop the job), left/right (cut).",
            ),
            _opt(
                "--max-num-seqs",
                type=int,
                help=f"Sequences in flight at once (the largest decode batch); on the CPU without --kv-cache-tokens, only as many as the KV cache holds at full length. {per_device('max_num_seqs')}",
            ),
            _opt(
                "--max-num-batched-tokens",
                type=int,
                help=f"Tokens one engine step may run: decodes plus prompt chunks (long prompts are prefilled in chunks). {per_device('max_num_batched_tokens')}",
            ),
            _opt(
                "--block-size",
                type=int,
                help="KV cache block size in tokens (the paging and prefix-caching unit).",
            ),
            _opt(
                "--kv-cache-tokens",
                type=int,
                help=f"KV cache capacity in tokens. Default: on the CPU what the job needs (longest row x max-num-seqs); on a GPU {ENGINE_DEFAULTS.gpu_memory_utilization:.0%} of free memory.",
            ),
            _opt(
                "--prefix-caching/--no-prefix-caching",
                help="Reuse the KV cache blocks of prompt prefixes already computed (shared instructions, few-shot examples, templates).",
            ),
            _opt(
                "--window-rows",
                type=int,
                help="Rows read and tokenized ahead of the engine; it admits the longest of them first.",
            ),
        ]
    ):
        f = o(f)
    return f


def run_options(f):
    for o in reversed(
        [
            _opt(
                "--output",
                "-o",
                help="Output directory of Parquet part files (required, or from the job spec).",
            ),
            _opt("--passthrough", help="Comma-separated input columns to copy. Default: all."),
            _opt(
                "--temperature",
                type=float,
                help="0 = greedy (a temperature column overrides per row). Default: the model's generation_config.json (do_sample false: 0), else 0.",
            ),
            _opt(
                "--top-k",
                type=int,
                help="Sample from the k most likely tokens (0 = off). Default: the model's generation_config.json, else 0.",
            ),
            _opt(
                "--top-p",
                type=float,
                help="Nucleus sampling mass (1 = off; a top_p column overrides per row). Default: the model's generation_config.json, else 1.",
            ),
            _opt(
                "--seed",
                type=int,
                help="Job sampling seed: each row samples with its own seed, derived from this and its id, so rows are independent and a row's output does not depend on its batch, order or --limit (a seed column sets a row's seed itself).",
            ),
            _opt(
                "--stop",
                multiple=True,
                default=(),
                help=(
                    "Stop string (repeatable). On the command line \\n, \\t and \\\\ are read "
                    "as a newline, a tab and a backslash."
                ),
            ),
            _opt("--stop-token-ids", type=int, multiple=True, help=_HELP["stop_token_ids"]),
            _opt("--min-tokens", type=int, help=_HELP["min_tokens"]),
            _opt("--min-p", type=float, help=_HELP["min_p"]),
            _opt("--ignore-eos", is_flag=True, help="Generate max_new_tokens even past EOS."),
            _opt(
                "--task",
                help="generate: sample a completion per row. score: the probability of each --choice label (or choice column) given the prompt, in `scores` and `label` columns; nothing is sampled.",
            ),
            _opt(
                "--n",
                type=int,
                help="Sampled completions per row (an n column overrides per row): one output row each, keyed by (id, sample_index), each with its own seed; use with --temperature > 0.",
            ),
            _opt(
                "--n-as-list",
                is_flag=True,
                help="With --n: one output row per input row, its samples' text, finish_reason, completion_tokens (token_ids, logprobs) as lists in sample order.",
            ),
            _opt(
                "--choice",
                help='Structured output: the output is one of these comma-separated labels, e.g. "positive,negative,neutral" (a choice list column overrides per row). After a prompt ending in a word ("Sentiment:"), a label also matches its space-prefixed form (" positive", as tokenizers write it); the output is the label as written.',
            ),
            _opt(
                "--regex",
                help="Structured output: the output matches this regular expression (a regex column overrides per row).",
            ),
            _opt(
                "--json-schema",
                help="Structured output: a JSON schema the output must match, inline ('{\"type\": ...}': it starts with {) or a file (a json_schema column of schema text overrides per row).",
            ),
            _opt(
                "--json-any-whitespace",
                is_flag=True,
                help="JSON outputs may put any whitespace between tokens. Default: compact (one space after each , and :), so a model cannot loop on newlines.",
            ),
            _opt("--device", help="auto, cpu, cuda, cuda:N."),
            _opt("--dtype", help="auto = bfloat16 on GPU, float32 on CPU."),
            _opt(
                "--model-impl",
                help="Which code runs the model: native (batchgen's decoder: gpt2, llama, mistral, qwen2, qwen3), transformers (transformers' modeling code with batchgen's paged attention: other causal LMs), or auto (native where it has the family).",
            ),
            _opt(
                "--compile/--no-compile",
                help=(
                    "torch.compile the decode steps (as CUDA graphs on a GPU; prefill runs "
                    "eagerly): one compile of the model, then a CUDA graph per batch size, "
                    "before the first row. Default: on with a GPU, off on the CPU (measured "
                    "no faster there)."
                ),
            ),
            _opt(
                "--compile-cache",
                metavar="DIR",
                help=(
                    "Where compiled graphs are kept across jobs (a shared filesystem lets a "
                    "Slurm array's tasks share them); 'off' for none. Default: "
                    "$BATCHGEN_COMPILE_CACHE, else ~/.cache/batchgen/compile."
                ),
            ),
            _opt(
                "--lora",
                help="PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), merged into the model's weights at load, before --quantize.",
            ),
            _opt("--quantize", help="Weight-only quantization."),
            _opt("--quant-backend", help="Quantization library (auto picks per device)."),
            _opt(
                "--quant-group-size",
                type=int,
                help="int4: the largest group of input channels (32, 64, 128, 256); a layer it does not divide gets the largest one that does. Default: 128.",
            ),
            _opt("--rows-per-part", type=int, help="Rows per output Parquet part file."),
            _opt("--flush-seconds", type=float, help="Write a part at least this often."),
            _opt(
                "--max-error-rate",
                type=click.FloatRange(0, 1),
                help="Exit 1, after writing every row, when more than this share of the run's rows are error rows (their reasons are listed at the end). A few bad rows (a null, an outlier past --max-prompt-len) are normal in real data; more than 1 in 10 almost always means a wrong template, column or limit. 1.0: never.",
            ),
            _opt(
                "--progress-seconds",
                type=click.FloatRange(0),
                help="When stderr is not a terminal (a Slurm log, a pipe), print a progress line this often: rows done/total, output tok/s, ETA, errors (also under --quiet). 0: never.",
            ),
            _opt("--with-token-ids", is_flag=True, help="Add a token_ids column."),
            _opt("--with-logprobs", is_flag=True, help="Add a logprobs column (each token's)."),
            _opt(
                "--with-timings",
                is_flag=True,
                help="Add queued_s, ttft_s, latency_s and tpot_s columns: each row's (each sample's) seconds from entering the engine's queue to its first and last token, and per output token after the first.",
            ),
            _opt(
                "--peak-tflops",
                type=float,
                help="The device's peak TFLOP/s for MFU in .batchgen/stats.json. Default: a table of known GPUs (x --tensor-parallel-size), measured once on the CPU.",
            ),
            _opt(
                "--peak-bandwidth-gbs",
                type=float,
                help="The device's peak memory bandwidth in GB/s for MBU. Default: as --peak-tflops.",
            ),
            _opt(
                "--output-format",
                help="openai: also write OUTPUT/.batchgen/results.jsonl, OpenAI batch output lines in input order (OpenAI batch input only).",
            ),
            _opt("--overwrite", is_flag=True, help="Replace another job's results in --output."),
            _opt("--quiet", "-q", is_flag=True, help="No progress bar (for schedulers' logs)."),
            _opt(
                "--allow-pickle",
                is_flag=True,
                help="Allow loading pytorch_model.bin pickle checkpoints (can run code).",
            ),
            _opt(
                "--threads",
                type=int,
                help="CPU threads for torch. Default: torch's (all cores); 1 is faster on a busy machine.",
            ),
            _opt(
                "--shard",
                help="Run only shard I/N of the rows (by id hash), into OUTPUT/shard-IIIII-of-NNNNN/. Default in a Slurm array task: SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT.",
            ),
            _opt(
                "--workers",
                type=str,
                help="auto or N: N processes (auto: one per visible GPU, or per group of --tensor-parallel-size GPUs) over shards of the input, then merged into OUTPUT/.batchgen/merged.parquet.",
            ),
            _opt(
                "--tensor-parallel-size",
                "-tp",
                type=int,
                help="Split the model over N GPUs of this node (N processes, started by batchgen; NCCL), for a model larger than one GPU. On the CPU N processes over gloo: a test and debugging mode.",
            ),
        ]
    ):
        f = o(f)
    return f
