"""The two ends of the Makefile pipelines (mk/pipeline.mk): prepare the input, report the result.

    python scripts/pipeline.py prepare --rows 200 --out out/label/input.parquet
    python scripts/pipeline.py report label out/label/run        # accuracy vs the true labels
    python scripts/pipeline.py report summary out/summarize/run  # matches vs reference summaries

`prepare` takes a seeded random sample of the shipped reviews (the same rows on every run), so
the pipeline has an input file of its own, as a real one would. `report` reads a merged output
(OUT/.batchgen/merged.pq and OUT/.batchgen/stats.json, from `batchgen merge OUT`).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from batchgen.data.layout import MERGED_FILE, STATS_FILE

SAMPLES = Path(__file__).resolve().parents[1] / "batchgen" / "assets" / "samples"


def prepare(rows: int, out: Path, source: str = "reviews", seed: int = 0) -> None:
    table = pq.read_table(SAMPLES / f"{source}.parquet")
    keep = sorted(random.Random(seed).sample(range(table.num_rows), min(rows, table.num_rows)))
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.take(keep), out)
    print(f"wrote {out}: {len(keep)} of {table.num_rows} rows of builtin:samples/{source}.parquet")


def _load(run_dir: Path) -> tuple[list[dict], dict]:
    rows = pq.read_table(run_dir / MERGED_FILE).to_pylist()
    stats = json.loads((run_dir / STATS_FILE).read_text())
    return rows, stats


def _seconds(s: float) -> str:
    """Seconds to three significant figures (0.0756, 12.3, 4210): a rate recomputed from the
    printed time agrees with the printed rate, however short the run."""
    return f"{s:.3g}" if s < 1000 else f"{s:.0f}"


def _throughput(stats: dict) -> str:
    """The rates over the time they are rates of: the union of the shards' run intervals
    (merge's wall_s; shards run one after the other add up, side by side overlap once)."""
    return (
        f"{stats['rows']} rows over {stats['shards']} shard(s) in {_seconds(stats['wall_s'])} s "
        f"(the shards' run intervals; the slowest shard {_seconds(stats['max_wall_s'])} s): "
        f"{stats['rows_per_s']:.1f} rows/s, {stats['output_tokens_per_s']:.1f} output tokens/s"
    )


def report_labels(run_dir: Path) -> None:
    rows, stats = _load(run_dir)
    ok = [r for r in rows if r["error"] is None]
    predicted = [(r["label"], (r["generated_text"] or "").strip()) for r in ok]
    right = sum(p == t for t, p in predicted)
    print(
        f"label accuracy: {right}/{len(ok)} = {right / max(1, len(ok)):.1%}"
        f"  ({len(rows) - len(ok)} rows with errors)"
    )
    labels = sorted({t for t, _ in predicted})
    pairs = Counter(predicted)
    corner = "true \\ predicted"
    cols = [*labels, "other"]
    first, width = max(len(x) for x in [*labels, corner]), max(len(x) for x in cols)
    print(f"{corner:<{first}}  " + "  ".join(f"{c:>{width}}" for c in cols))
    for t in labels:
        counts = [pairs[(t, p)] for p in labels]
        counts.append(sum(n for (tt, p), n in pairs.items() if tt == t and p not in labels))
        print(f"{t:<{first}}  " + "  ".join(f"{n:>{width}}" for n in counts))
    print(_throughput(stats))


def report_summaries(run_dir: Path, show: int = 3) -> None:
    rows, stats = _load(run_dir)
    ok = [r for r in rows if r["error"] is None]
    exact = sum((r["generated_text"] or "").strip() == r["summary"] for r in ok)
    # "The reviewer liked/disliked/found ...": does the summary carry the reference's verdict?
    verdict = sum(_verdict(r["generated_text"]) == _verdict(r["summary"]) for r in ok)
    print(
        f"summaries equal to the reference: {exact}/{len(ok)} = {exact / max(1, len(ok)):.1%}; "
        f"same verdict (liked/disliked/found): {verdict / max(1, len(ok)):.1%}"
    )
    for r in sorted(ok, key=lambda r: r["id"])[:show]:
        print(f"  {r['id']}: {r['generated_text'].strip()!r}\n    reference: {r['summary']!r}")
    print(_throughput(stats))


def _verdict(summary: str | None) -> str | None:
    words = (summary or "").split()
    return words[2] if len(words) > 2 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="sample the shipped reviews into a Parquet file")
    pp.add_argument("--rows", type=int, default=200)
    pp.add_argument("--source", default="reviews", choices=["reviews", "topics"])
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--out", type=Path, required=True)
    rp = sub.add_parser("report", help="accuracy or summary matches, and throughput")
    rp.add_argument("kind", choices=["label", "summary"])
    rp.add_argument("run_dir", type=Path, help="a merged output directory")
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.rows, args.out, args.source, args.seed)
    elif args.kind == "label":
        report_labels(args.run_dir)
    else:
        report_summaries(args.run_dir)


if __name__ == "__main__":
    main()
