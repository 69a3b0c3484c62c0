"""The `batchgen` command line: parses into a RunConfig and calls run()."""

from __future__ import annotations

import logging
import sys

import click

from batchgen.config import (
    BOUNDS,
    Choice,
    ConfigError,
    Dtype,
    OutputFormat,
    QuantBackend,
    QuantMethod,
    RunConfig,
    Task,
    Truncate,
)
from batchgen.jobspec import is_job_spec, load_job_spec, resolve_path

EXIT_USAGE = 2
EXIT_CODES = """\b
Exit codes:
  0    done (or already complete)
  1    a runtime failure: a full disk, another run holding OUTPUT, a too-long prompt under
       --truncate error, a failed worker; what is finished is kept, rerun to resume
  2    a usage or input error, reported before the model loads where it can be: a bad flag
       or job spec value, an unreadable input, model or config.json, another job's OUTPUT
  128+N  stopped by signal N (143: SIGTERM, 130: SIGINT); finished rows are saved, rerun to resume
"""


def _default(name: str):
    import dataclasses

    f = next(f for f in dataclasses.fields(RunConfig) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default.value if isinstance(f.default, Choice) else f.default
    return None


def _choice(choice: type[Choice]) -> click.Choice:
    return click.Choice([c.value for c in choice])


def _opt(*decls: str, **kw):
    """An option whose default and help come from RunConfig, so there is one source."""
    name = decls[0].lstrip("-").split("/")[0].replace("-", "_")
    if name in BOUNDS and kw.get("type") in (int, float):  # RunConfig's range, checked by click
        b = BOUNDS[name]
        kw["type"] = (click.IntRange if kw["type"] is int else click.FloatRange)(
            min=b.low, max=b.high, min_open=b.low_open
        )
    kw.setdefault("default", _default(name))
    kw.setdefault("show_default", kw["default"] not in (None, False, ()))
    return click.option(*decls, name, **kw)


def data_options(f):
    for o in reversed([
        _opt("--input", "-i", help="Input data; overrides a job spec's input (builtin:samples/... for the shipped samples)."),
        _opt("--model", "-m", help="Local model directory (config.json + *.safetensors). Default: the embedded demo model."),
        _opt("--prompt-column", help="Input column holding the prompt text."),
        _opt("--messages-column", help="Input column of chat messages [{role, content}], rendered with the tokenizer's chat template."),
        _opt("--template", "-t", help='Jinja prompt template over input columns, e.g. "Label the sentiment of: {{ text }}".'),
        _opt("--id-column", help="Input column of unique row ids. Default: the row number."),
        _opt("--limit", type=int, help="Only the first N input rows."),
        _opt("--max-new-tokens", type=int, help="Tokens to generate per row (a max_new_tokens column overrides per row)."),
        _opt("--max-prompt-len", type=int, help="Longest prompt in tokens (the largest length bucket)."),
        _opt("--truncate", type=_choice(Truncate), help="Prompts over --max-prompt-len: skip (error record), error (stop the job), left/right (cut)."),
        _opt("--max-num-seqs", type=int, help="Sequences in flight at once (the largest decode batch). Default: 64 on CPU, 256 on GPU."),
        _opt("--max-num-batched-tokens", type=int, help="Tokens one engine step may run: decodes plus prompt chunks (long prompts are prefilled in chunks). Default: 2048 on CPU, 8192 on GPU."),
        _opt("--block-size", type=int, help="KV cache block size in tokens (the paging and prefix-caching unit)."),
        _opt("--kv-cache-tokens", type=int, help="KV cache capacity in tokens. Default: on the CPU what the job needs (longest row x max-num-seqs); on a GPU 80% of free memory."),
        _opt("--prefix-caching/--no-prefix-caching", help="Reuse the KV cache blocks of prompt prefixes already computed (shared instructions, few-shot examples, templates)."),
        _opt("--window-rows", type=int, help="Rows read and tokenized ahead of the engine; it admits the longest of them first."),
    ]):  # fmt: skip
        f = o(f)
    return f


def run_options(f):
    for o in reversed([
        _opt("--output", "-o", help="Output directory of Parquet part files (required, or from the job spec)."),
        _opt("--passthrough", help="Comma-separated input columns to copy to the output. Default: all."),
        _opt("--temperature", type=float, help="0 = greedy (a temperature column overrides per row)."),
        _opt("--top-k", type=int, help="Sample from the k most likely tokens (0 = off)."),
        _opt("--top-p", type=float, help="Nucleus sampling mass (1 = off; a top_p column overrides per row)."),
        _opt("--seed", type=int, help="Job sampling seed: each row samples with its own seed, derived from this and its id, so rows are independent and a row's output does not depend on its batch, order or --limit (a seed column sets a row's seed itself)."),
        _opt("--stop", multiple=True, default=(), help="Stop string (repeatable)."),
        _opt("--ignore-eos", is_flag=True, help="Generate max_new_tokens even past EOS."),
        _opt("--task", type=_choice(Task), help="generate: sample a completion per row. score: the probability of each --choice label (or choice column) given the prompt, in `scores` and `label` columns; nothing is sampled."),
        _opt("--n", type=int, help="Sampled completions per row (an n column overrides per row): one output row each, keyed by (id, sample_index), each with its own seed; use with --temperature > 0."),
        _opt("--choice", help='Structured output: the output is one of these comma-separated labels, e.g. "positive,negative,neutral" (a choice list column overrides per row).'),
        _opt("--regex", help="Structured output: the output matches this regular expression (a regex column overrides per row)."),
        _opt("--json-schema", help="Structured output: a JSON schema file the output must match (a json_schema column of schema text overrides per row)."),
        _opt("--device", help="auto, cpu, cuda, cuda:N."),
        _opt("--dtype", type=_choice(Dtype), help="auto = bfloat16 on GPU, float32 on CPU."),
        _opt("--compile/--no-compile", help="torch.compile prefill and decode (decode as CUDA graphs). Default: on with a GPU, off on the CPU, where compiling costs 10-70 s a shape and measured no faster."),
        _opt("--lora", help="PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), merged into the model's weights at load, before --quantize."),
        _opt("--quantize", type=_choice(QuantMethod), help="Weight-only quantization."),
        _opt("--quant-backend", type=_choice(QuantBackend), help="Quantization library (auto picks per device)."),
        _opt("--quant-group-size", type=int, help="int4: the largest group of input channels (32, 64, 128, 256); a layer it does not divide gets the largest one that does. Default: 128."),
        _opt("--rows-per-part", type=int, help="Rows per output Parquet part file."),
        _opt("--flush-seconds", type=float, help="Write a part at least this often."),
        _opt("--with-token-ids", is_flag=True, help="Add a token_ids column."),
        _opt("--with-logprobs", is_flag=True, help="Add a logprobs column (log-probability of each generated token)."),
        _opt("--output-format", type=click.Choice([f.value for f in OutputFormat]), help="openai: also write OUTPUT/results.jsonl, OpenAI batch output lines in input order (OpenAI batch input only)."),
        _opt("--overwrite", is_flag=True, help="Replace another job's results in --output."),
        _opt("--quiet", "-q", is_flag=True, help="No progress bar (for schedulers' logs)."),
        _opt("--allow-pickle", is_flag=True, help="Allow loading pytorch_model.bin pickle checkpoints (can run code)."),
        _opt("--threads", type=int, help="CPU threads for torch. Default: torch's (all cores); 1 is faster on a busy machine."),
        _opt("--shard", help="Run only shard I/N of the rows (by id hash), into OUTPUT/shard-IIIII-of-NNNNN/. Default in a Slurm array task: SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT."),
        _opt("--workers", type=str, help="auto or N: N processes (auto: one per visible GPU) over shards of the input, then merged into OUTPUT/merged.parquet."),
    ]):  # fmt: skip
        f = o(f)
    return f


def build_config(ctx: click.Context, source: str, **flags) -> RunConfig:
    """Job spec values (if SOURCE is a .yaml), overridden by flags given on the line."""
    values: dict = {}
    if is_job_spec(source):
        values = load_job_spec(source)
    else:
        values["input"] = resolve_path(source)
        if flags.get("input") is not None:
            raise ConfigError(f"input {source} and --input {flags['input']}: pass one of them")
    if flags.get("input") is not None:
        flags["input"] = resolve_path(flags["input"])
    for name, value in flags.items():
        # None: not one of this command's options (passed by the command itself)
        given = ctx.get_parameter_source(name) in (
            None,
            click.core.ParameterSource.COMMANDLINE,
            click.core.ParameterSource.ENVIRONMENT,
        )
        if given or name not in values:
            values[name] = value
    if "shard" in flags and values.get("shard") is None:
        values["shard"] = _shard_from_env(values.get("workers", 1))
    if isinstance(values.get("passthrough"), str):
        values["passthrough"] = [c.strip() for c in values["passthrough"].split(",") if c.strip()]
    if isinstance(values.get("choice"), str):  # "a, b,c" on the command line
        values["choice"] = [c.strip() for c in values["choice"].split(",")]
    if isinstance(values.get("stop"), tuple | list):
        values["stop"] = list(values["stop"])
    return RunConfig.from_mapping(values, source)


def _shard_from_env(workers) -> str | None:
    """The shard of a Slurm array task (SLURM_ARRAY_TASK_ID/COUNT), for runs without --shard."""
    from batchgen.scaleout.shard import ShardError, shard_from_env

    try:
        shard = shard_from_env()
    except ShardError as e:
        raise ConfigError(str(e)) from None
    if shard is not None and str(workers) != "1":
        raise ConfigError(
            f"this is Slurm array task {shard} (SLURM_ARRAY_TASK_ID is set), which runs one shard; "
            "--workers splits a whole job, so use one or the other"
        )
    return str(shard) if shard else None


def _fail(msg: str, code: int) -> None:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="batchgen")
def main() -> None:
    """batchgen: offline batch LLM inference.

    Reads prompts from Parquet/JSONL/datasets, tokenizes them, runs them through one
    continuous-batching engine on a paged KV cache (prefix caching, chunked prefill,
    compiled decode and CUDA graphs on a GPU) and streams results back to Parquet.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command("run", epilog=EXIT_CODES)
@click.argument("source")
@data_options
@run_options
@click.pass_context
def run_cmd(ctx: click.Context, source: str, **flags) -> None:
    """Generate for every row of SOURCE (Parquet file/dir/glob, JSONL, datasets dir, or a
    job spec .yaml whose values the flags override).

    \b
    Examples:
      batchgen run prompts.parquet -o out/
      batchgen run reviews.parquet -o out/ -t "Review: {{ text }}\\nSentiment:" --max-new-tokens 2
      batchgen run jobs/label_sentiment.yaml --limit 100
    A killed or preempted job resumes when the same command runs again.
    """
    from batchgen.data import InputError, OutputError
    from batchgen.model.loader import ModelLoadError
    from batchgen.quant import QuantUnavailableError
    from batchgen.run import JobInterrupted, run
    from batchgen.scaleout.merge import MergeError
    from batchgen.scaleout.workers import WorkersFailed, run_workers
    from batchgen.tokenization import PromptTooLong

    try:
        cfg = build_config(ctx, source, **flags)
        if cfg.workers != 1:  # one process per GPU (or N on the CPU) over shards, then merged
            click.echo(run_workers(cfg).table())
            return
        stats = run(cfg)
    except (ConfigError, InputError, ModelLoadError, QuantUnavailableError) as e:
        _fail(str(e), EXIT_USAGE)
    except (PromptTooLong, WorkersFailed, MergeError, OutputError) as e:
        _fail(str(e), 1)
    except JobInterrupted as e:
        _fail(str(e), 128 + e.signum)
    if not cfg.quiet:
        click.echo(f"\nwrote {cfg.output_dir}\n{stats.table()}")
    else:
        d = stats.to_dict()
        rate = f"{d['rows_per_s']:.1f} rows/s" if cfg.task is Task.SCORE else f"{d['output_tokens_per_s']:.1f} output tokens/s"  # fmt: skip
        click.echo(f"wrote {cfg.output_dir}: {stats.rows} rows, {rate}")


@main.command("plan")
@click.argument("source")
@data_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan_cmd(ctx: click.Context, source: str, as_json: bool, **flags) -> None:
    """Show what SOURCE would run, without loading the weights: rows, prompt length
    histogram, the engine's budgets and the KV cache it would allocate."""
    import json

    from batchgen.data import InputError
    from batchgen.model.loader import ModelLoadError
    from batchgen.plan_report import format_plan, make_plan

    try:
        cfg = build_config(ctx, source, output="(plan)", **flags)
        report = make_plan(cfg)
    except (ConfigError, InputError, ModelLoadError) as e:
        _fail(str(e), EXIT_USAGE)
    click.echo(json.dumps(report, indent=2) if as_json else format_plan(report))


@main.command("slurm", context_settings={"ignore_unknown_options": True})
@click.argument("source")
@click.option(
    "--shards", type=click.IntRange(min=1), required=True, help="Number of shards = array tasks."
)
@click.option("--partition", "-p", help="Slurm partition.")
@click.option("--gpus-per-task", type=int, help="GPUs per task (one shard per task).")
@click.option("--cpus-per-task", type=int, help="CPUs per task.")
@click.option("--mem", help="Memory per task, e.g. 32G.")
@click.option(
    "--time", help="Time limit per task, e.g. 04:00:00; a task near it saves, requeues and resumes."
)
@click.option(
    "--only", help="Comma-separated shard numbers to (re)submit, e.g. 2,5 (default: all)."
)
@click.option("--max-parallel", type=int, help="At most this many tasks at once.")
@click.option(
    "--grace",
    "grace_s",
    type=int,
    default=120,
    show_default=True,
    help="Seconds before the time limit to stop and requeue.",
)
@click.option("--job-name", default="batchgen", show_default=True)
@click.option(
    "--sbatch-arg",
    "extra",
    multiple=True,
    help="Another sbatch option, e.g. --sbatch-arg=--account=abc (repeatable).",
)
@click.option("--dry-run", is_flag=True, help="Print the script instead of submitting it.")
@click.argument("run_args", nargs=-1, type=click.UNPROCESSED)
def slurm_cmd(
    source: str, run_args: tuple[str, ...], dry_run: bool, only: str | None, **opts
) -> None:
    """Submit SOURCE (a job spec .yaml, or data with run flags) as a Slurm job array: task I
    runs `batchgen run SOURCE --shard I/N` into OUTPUT/shard-IIIII-of-NNNNN/.

    \b
    Examples:
      batchgen slurm jobs/label_sentiment.yaml --shards 8 -p gpu --gpus-per-task 1 --time 2:00:00
      batchgen slurm jobs/summarize.yaml --shards 4 --dry-run -- --limit 1000 --no-compile
    Flags after -- go to every `batchgen run`. When all tasks are done: batchgen merge OUTPUT.
    """
    from batchgen.scaleout.slurm import (
        SbatchOptions,
        SlurmError,
        sbatch_script,
        submit,
        write_script,
    )

    args = [a for a in run_args if a != "--"]
    try:
        if any(a.split("=")[0] in ("--shard", "--workers") for a in args):
            raise ConfigError("batchgen slurm picks each task's shard; leave out --shard/--workers")
        # Parse and check the job exactly as each task's `batchgen run` will.
        run_ctx = run_cmd.make_context("run", [source, *args, "--shard", f"0/{opts['shards']}"])
        params = {k: v for k, v in run_ctx.params.items() if k != "source"}
        cfg = build_config(run_ctx, source, **params)
        shards = tuple(int(i) for i in only.split(",")) if only else ()
        sb = SbatchOptions(only=shards, **opts)
        script = sbatch_script(source, cfg, args, sb)
        if dry_run:
            click.echo(script)
            return
        path = write_script(cfg.output, script)
        job_id = submit(path)
    except (ConfigError, SlurmError, ValueError) as e:
        _fail(str(e), EXIT_USAGE)
    except click.UsageError as e:
        _fail(f"in the run flags: {e.format_message()}", EXIT_USAGE)
    click.echo(job_id)
    click.echo(
        f"submitted {sb.array} of {sb.shards} shards as job {job_id} (script {path}); "
        f"logs in {cfg.output}/logs/; when all are done: batchgen merge {cfg.output}",
        err=True,
    )


@main.command("merge")
@click.argument("output")
@click.option(
    "--stats-only", is_flag=True, help="Check and write _stats.json, without merged.parquet."
)
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
def merge_cmd(output: str, stats_only: bool, as_json: bool) -> None:
    """Check that every shard in OUTPUT finished and belongs to one job, then write
    OUTPUT/merged.parquet and OUTPUT/_stats.json (totals and a per-shard table).
    Missing, unfinished or mismatched shards are listed by number and nothing is merged."""
    import json

    from batchgen.data import OutputError
    from batchgen.scaleout.merge import MergeError, merge

    try:
        summary = merge(output, write_data=not stats_only)
    except (MergeError, OutputError) as e:
        _fail(str(e), 1)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else summary.table())


if __name__ == "__main__":
    main()
