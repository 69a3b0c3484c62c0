"""The `batchgen` command line: parses into a RunConfig and calls run()."""

from __future__ import annotations

import logging
import sys

import click

from batchgen.config import ConfigError, RunConfig, Truncate
from batchgen.jobspec import is_job_spec, load_job_spec, resolve_path

EXIT_USAGE = 2


def _default(name: str):
    import dataclasses

    f = next(f for f in dataclasses.fields(RunConfig) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default.value if isinstance(f.default, Truncate) else f.default
    return None


def _opt(*decls: str, **kw):
    """An option whose default and help come from RunConfig, so there is one source."""
    name = decls[0].lstrip("-").split("/")[0].replace("-", "_")
    kw.setdefault("default", _default(name))
    kw.setdefault("show_default", kw["default"] not in (None, False, ()))
    return click.option(*decls, name, **kw)


def data_options(f):
    for o in reversed([
        _opt("--model", "-m", help="Local model directory (config.json + *.safetensors). Default: the embedded demo model."),
        _opt("--prompt-column", help="Input column holding the prompt text."),
        _opt("--messages-column", help="Input column of chat messages [{role, content}], rendered with the tokenizer's chat template."),
        _opt("--template", "-t", help='Jinja prompt template over input columns, e.g. "Label the sentiment of: {{ text }}".'),
        _opt("--id-column", help="Input column of unique row ids. Default: the row number."),
        _opt("--limit", type=int, help="Only the first N input rows."),
        _opt("--max-new-tokens", type=int, help="Tokens to generate per row (a max_new_tokens column overrides per row)."),
        _opt("--max-prompt-len", type=int, help="Longest prompt in tokens (the largest length bucket)."),
        _opt("--truncate", type=click.Choice([t.value for t in Truncate]), help="Prompts over --max-prompt-len: skip (error record), error (stop the job), left/right (cut)."),
        _opt("--max-batch", type=int, help="Largest batch. Default: 64 on CPU, 256 on GPU."),
        _opt("--prefill-token-budget", type=int, help="Max prompt tokens (batch x bucket length) in one prefill."),
        _opt("--kv-cache-tokens", type=int, help="KV cache capacity in tokens. Default: 80% of free GPU memory, 2 GiB on CPU."),
        _opt("--window-rows", type=int, help="Rows tokenized, sorted and bucketed together."),
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
        _opt("--seed", type=int, help="Sampling seed; each row's output depends only on its seed (a seed column overrides)."),
        _opt("--stop", multiple=True, default=(), help="Stop string (repeatable)."),
        _opt("--ignore-eos", is_flag=True, help="Generate max_new_tokens even past EOS."),
        _opt("--device", help="auto, cpu, cuda, cuda:N."),
        _opt("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), help="auto = bfloat16 on GPU, float32 on CPU."),
        _opt("--compile/--no-compile", help="torch.compile prefill and decode (CUDA graphs on GPU). --no-compile runs eager, for debugging."),
        _opt("--quantize", type=click.Choice(["none", "int8", "int4", "fp8"]), help="Weight-only quantization."),
        _opt("--quant-backend", type=click.Choice(["auto", "torchao", "quanto"]), help="Quantization library (auto picks per device)."),
        _opt("--rows-per-part", type=int, help="Rows per output Parquet part file."),
        _opt("--flush-seconds", type=float, help="Write a part at least this often."),
        _opt("--with-token-ids", is_flag=True, help="Add a token_ids column."),
        _opt("--with-logprobs", is_flag=True, help="Add a logprobs column (log-probability of each generated token)."),
        _opt("--overwrite", is_flag=True, help="Replace another job's results in --output."),
        _opt("--quiet", "-q", is_flag=True, help="No progress bar (for schedulers' logs)."),
        _opt("--allow-pickle", is_flag=True, help="Allow loading pytorch_model.bin pickle checkpoints (can run code)."),
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
    for name, value in flags.items():
        # None: not one of this command's options (passed by the command itself)
        given = ctx.get_parameter_source(name) in (
            None,
            click.core.ParameterSource.COMMANDLINE,
            click.core.ParameterSource.ENVIRONMENT,
        )
        if given or name not in values:
            values[name] = value
    if isinstance(values.get("passthrough"), str):
        values["passthrough"] = [c.strip() for c in values["passthrough"].split(",") if c.strip()]
    if isinstance(values.get("stop"), tuple | list):
        values["stop"] = list(values["stop"])
    return RunConfig.from_mapping(values, source)


def _fail(msg: str, code: int) -> None:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="batchgen")
def main() -> None:
    """batchgen: offline batch LLM inference.

    Reads prompts from Parquet/JSONL/datasets, sorts them into length buckets, runs a
    compiled decoder with a static KV cache, and streams results back to Parquet.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command("run")
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
    from batchgen.data import InputError
    from batchgen.model.loader import ModelLoadError
    from batchgen.run import JobInterrupted, run
    from batchgen.tokenize import PromptTooLong

    try:
        cfg = build_config(ctx, source, **flags)
        stats = run(cfg)
    except (ConfigError, InputError, ModelLoadError) as e:
        _fail(str(e), EXIT_USAGE)
    except PromptTooLong as e:
        _fail(str(e), 1)
    except JobInterrupted as e:
        _fail(str(e), 128 + e.signum)
    if not cfg.quiet:
        click.echo(f"\nwrote {cfg.output}\n{stats.table()}")
    else:
        click.echo(
            f"wrote {cfg.output}: {stats.rows} rows, {stats.to_dict()['output_tokens_per_s']:.1f} output tokens/s"
        )


@main.command("plan")
@click.argument("source")
@data_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan_cmd(ctx: click.Context, source: str, as_json: bool, **flags) -> None:
    """Show how SOURCE would be bucketed and batched, without running the model:
    length histogram, buckets, batch sizes, padding efficiency, KV cache memory."""
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


if __name__ == "__main__":
    main()
