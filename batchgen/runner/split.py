"""One output directory, one way of splitting its job: a run with --shard I/N (writing
OUT/shard-I-of-N/) and a run without (writing OUT's own parts) are two jobs, and every
directory reader, and a merge, would read both (the README's label_sentiment block, run
unsharded and then as 8 shards into one OUT, read 400 rows for 200). Refused before anything
is written; `--workers` checks its split the same way (scaleout/workers.py)."""

from __future__ import annotations

from pathlib import Path

from batchgen.data.layout import holds_unsharded_run
from batchgen.errors import InputError
from batchgen.job.config import RunConfig
from batchgen.job.shard import Shard


def shard_counts(out: Path) -> list[int]:
    """The split counts N of the shard-I-of-N folders in out."""
    found = {s.count for p in out.iterdir() if p.is_dir() and (s := Shard.from_dirname(p.name))}
    return sorted(found)


def check_split(cfg: RunConfig) -> None:
    """Refuse a sharded run into an unsharded job's output, the reverse, and a shard of an
    N-way split beside another split's shards."""
    out = Path(cfg.output)
    if not out.is_dir():
        return  # a new output (OutputDir says what is wrong with a file)
    if cfg.shard is not None and holds_unsharded_run(out):
        raise InputError(
            f"output {out} holds the results of a run without --shard, another job than shard "
            f"{cfg.shard.index}/{cfg.shard.count} (a merge would read both); rerun without "
            "--shard to resume it, or pick another output directory"
        )
    counts = shard_counts(out)
    if cfg.shard is None and counts:
        raise InputError(
            f"output {out} holds the shards of a {counts[0]}-way sharded run, another job than "
            f"one without --shard (readers would see both); rerun with --shard I/{counts[0]} to "
            "resume it, or pick another output directory"
        )
    other = [n for n in counts if cfg.shard is not None and n != cfg.shard.count]
    if other:
        raise InputError(
            f"output {out} holds the shards of a {other[0]}-way split, and --shard "
            f"{cfg.shard.index}/{cfg.shard.count} splits the rows {cfg.shard.count} ways; "
            f"rerun with --shard I/{other[0]} to resume it, or pick another output directory"
        )
