"""The `batchgen` command line: parses into a RunConfig and calls run()."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import click

from batchgen.choices import Task
from batchgen.cli.help import EXIT_CODES, SectionedCommand
from batchgen.cli.jobspec import build_config
from batchgen.cli.options import data_options, run_options
from batchgen.errors import ConfigError, JobInterrupted, RuntimeFailure, UsageError
from batchgen.job.precheck import precheck

EXIT_USAGE = 2


def _fail(msg: str, code: int) -> None:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(code)


@contextmanager
def _exit_on_sigint() -> Iterator[None]:
    """SIGINT exits at once with the usual line and 130. Raised as KeyboardInterrupt, it could
    land inside an import (torch, numpy), which turns it into an ImportError traceback."""

    def handler(signum: int, frame: object) -> None:
        sys.stderr.write(f"Error: {JobInterrupted(signum)}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="batchgen")
def main() -> None:
    """batchgen: offline batch LLM inference.

    Reads prompts from Parquet/JSONL/datasets, tokenizes them, runs them through one
    continuous-batching engine on a paged KV cache (prefix caching, chunked prefill,
    compiled decode and CUDA graphs on a GPU) and streams results back to Parquet.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command("run", cls=SectionedCommand, epilog=EXIT_CODES)
@click.argument("source")
@data_options
@run_options
@click.option(
    "--dry-run",
    is_flag=True,
    help=(
        "Print the processes the job would start (workers, tensor-parallel ranks, their devices) "
        "and exit."
    ),
)
@click.pass_context
def run_cmd(ctx: click.Context, source: str, dry_run: bool, **flags) -> None:
    """Generate for every row of SOURCE (Parquet file/dir/glob, JSONL, datasets dir, or a
    job spec .yaml whose values the flags override).

    \b
    Examples:
      batchgen run prompts.parquet -o out/prompts
      batchgen run reviews.parquet -o out/r -t "Review: {{ text }}\\nSentiment:" --max-new-tokens 2
      batchgen run jobs/label_sentiment.yaml --limit 100
    A killed or preempted job resumes when the same command runs again.
    """
    try:
        with _exit_on_sigint():  # start-up: nothing to save; the job's loop has its own handler
            cfg = build_config(ctx, source, **flags)
            precheck(cfg)  # paths and input, before torch loads

            from batchgen.runner.run import run
            from batchgen.scaleout.workers import describe_workers, run_workers

            if dry_run:
                click.echo(describe_workers(cfg))
                return
            if cfg.workers != 1:  # one process per GPU (or N on the CPU) over shards, merged
                summary = run_workers(cfg)
                click.echo(f"{summary.table()}\nplots and metrics: batchgen report {cfg.output}")
                if summary.verdict is not None and not summary.verdict.passed:
                    _fail(summary.verdict.line(), 1)
                return
            stats = run(cfg)
    except UsageError as e:
        _fail(str(e), EXIT_USAGE)
    except RuntimeFailure as e:
        _fail(str(e), 1)
    except JobInterrupted as e:
        _fail(str(e), 128 + e.signum)
    except KeyboardInterrupt:  # a second SIGINT during the job's loop
        _fail(str(JobInterrupted(signal.SIGINT)), 128 + signal.SIGINT)
    verdict = stats.verdict  # the complete job's error rate, this run's or an earlier one's
    wrote = cfg.output_dir if cfg.results_path is None else f"{cfg.results_path} ({cfg.output_dir})"
    if stats.rows == 0 and stats.rows_skipped_done:  # a rerun of a finished job: no table of 0s
        click.echo(f"{cfg.output_dir}: all {stats.rows_skipped_done} rows were done before")
        if verdict is not None and not verdict.passed:  # its reasons, as the first run's
            click.echo("\n".join(["error rows by reason:", *verdict.reason_lines()]), err=True)
    elif not cfg.quiet:
        click.echo(f"\nwrote {wrote}\n{stats.table()}")
        click.echo(f"plots and metrics: batchgen report {cfg.output_dir}")
    else:
        d = stats.to_dict()
        rate = (
            f"{d['rows_per_s']:.1f} rows/s"
            if cfg.task is not Task.GENERATE
            else f"{d['output_tokens_per_s']:.1f} output tokens/s"
        )
        errors = f"{stats.rows_error} error{'s' * (stats.rows_error != 1)}"
        click.echo(f"wrote {wrote}: {stats.rows} rows ({errors}), {rate}")
        if stats.error_reasons:
            click.echo("\n".join(["error rows by reason:", *stats.error_lines()]), err=True)
    if verdict is not None and not verdict.passed:
        _fail(verdict.line(), 1)


@main.command("plan", cls=SectionedCommand)
@click.argument("source")
@data_options
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan_cmd(ctx: click.Context, source: str, as_json: bool, **flags) -> None:
    """Show what SOURCE would run, without loading the weights: rows, prompt length
    histogram, the engine's budgets and the KV cache it would allocate. Takes `run`'s
    options (--n, --choice, --task, --lora, --quantize, ...); -o is not needed."""
    import json

    from batchgen.cli.plan import format_plan, make_plan

    try:
        flags["output"] = flags["output"] or "(plan)"  # a job spec's output still wins
        cfg = build_config(ctx, source, **flags)
        report = make_plan(cfg)
    except UsageError as e:
        _fail(str(e), EXIT_USAGE)
    click.echo(json.dumps(report, indent=2) if as_json else format_plan(report))


@main.command("slurm", context_settings={"ignore_unknown_options": True})
@click.argument("source")
@click.option(
    "--shards", type=click.IntRange(min=1), required=True, help="Number of shards = array tasks."
)
@click.option("--partition", "-p", help="Slurm partition.")
@click.option(
    "--gpus-per-task",
    type=int,
    help="GPUs per task (one shard per task). Default with --tensor-parallel-size N: N.",
)
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
    Flags after -- go to every `batchgen run`; when all tasks are done, run the merge it prints.
    """
    from batchgen.runner.split import check_split
    from batchgen.scaleout.slurm import (
        SbatchOptions,
        SlurmError,
        merge_command,
        parse_only,
        sbatch_script,
        submit,
    )

    args = [a for a in run_args if a != "--"]
    try:
        if any(a.split("=")[0] in ("--shard", "--workers") for a in args):
            raise ConfigError("batchgen slurm picks each task's shard; leave out --shard/--workers")
        # Parse and check the job exactly as each task's `batchgen run` will.
        run_ctx = run_cmd.make_context("run", [source, *args, "--shard", f"0/{opts['shards']}"])
        params = {k: v for k, v in run_ctx.params.items() if k not in ("source", "dry_run")}
        cfg = build_config(run_ctx, source, **params)
        check_split(cfg)  # not into an unsharded job's output, nor beside another split
        sb = SbatchOptions(only=parse_only(only), **opts)
        script = sbatch_script(source, cfg, args, sb)
        if dry_run:
            click.echo(script)
            return
        job_id, path = submit(cfg.output, script)
    except (UsageError, SlurmError, ValueError) as e:
        _fail(str(e), EXIT_USAGE)
    except click.UsageError as e:
        _fail(f"in the run flags: {e.format_message()}", EXIT_USAGE)
    except RuntimeFailure as e:  # sbatch failed, or the script could not be written
        _fail(str(e), 1)
    click.echo(job_id)
    click.echo(
        f"submitted {sb.array} of {sb.shards} shards as job {job_id} (script {path}); "
        f"logs in {path.parent}/; when all are done: {merge_command(cfg)}",
        err=True,
    )


@main.command("merge")
@click.argument("output")
@click.option(
    "--stats-only",
    is_flag=True,
    help="Check and write the statistics, without .batchgen/merged.pq.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.option(
    "--max-error-rate",
    type=click.FloatRange(0, 1),
    help="Exit 1 when more than this share of all shards' rows are error rows (after merging; "
    "recorded in .batchgen/verdict.json). `batchgen slurm` prints the job's.",
)
def merge_cmd(output: str, stats_only: bool, as_json: bool, max_error_rate: float | None) -> None:
    """Check that every shard in OUTPUT finished and belongs to one job, then write
    OUTPUT/.batchgen/merged.pq and OUTPUT/.batchgen/stats.json (totals and a per-shard
    table). OUTPUT itself still reads as the dataset (pd.read_parquet(OUTPUT)), from the shards.
    Missing, unfinished or mismatched shards are listed by number and nothing is merged."""
    import json

    from batchgen.scaleout.merge import merge

    try:
        summary = merge(output, write_data=not stats_only, max_error_rate=max_error_rate)
    except UsageError as e:
        _fail(str(e), EXIT_USAGE)
    except RuntimeFailure as e:
        _fail(str(e), 1)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else summary.table())
    if summary.verdict is not None and not summary.verdict.passed:  # the whole job's
        click.echo("\n".join(["error rows by reason:", *summary.verdict.reason_lines()]), err=True)
        _fail(summary.verdict.line(), 1)


@main.command("report")
@click.argument("output")
def report_cmd(output: str) -> None:
    """Write OUTPUT/.batchgen/report.html: the run's metrics (throughput and batch over time,
    TTFT, TPOT and latency distributions, the roofline of its steps, the stats table) as one
    self-contained page. For a sharded output, run `batchgen merge OUTPUT` first."""
    from batchgen.report.page import write_report

    try:
        path = write_report(output)
    except UsageError as e:
        _fail(str(e), EXIT_USAGE)
    except RuntimeFailure as e:
        _fail(str(e), 1)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
