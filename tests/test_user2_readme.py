"""Every `batchgen ...` command in README.md's fenced code blocks runs as written (issue 31):
input files of the names it uses, the tiny Llama for a `--model` path, few rows and tokens.
Labeling commands write only their labels."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from helpers import ROOT, run_cli, write_jsonl, write_parquet

from batchgen.job.paths import resolve_path

# Commands that need what a test machine lacks, by a word of theirs.
SKIP = {
    "slurm": "submits to Slurm (tests/test_slurm.py runs it on a real cluster)",
    "--tensor-parallel-size": "several GPUs (tests/test_tensor_parallel_cli.py runs it on gloo)",
    "make": "not batchgen",
}
SENTIMENTS = {"positive", "negative", "neutral"}


def readme_commands() -> list[list[str]]:
    """The `batchgen` command lines of README.md's fenced sh blocks, continuations joined and
    comments dropped."""
    blocks = re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(x, comments=True) for x in lines if x.strip().startswith("batchgen ")]


def _inputs(cwd: Path) -> None:
    """The README's input files, of the shapes its commands expect."""
    prompts = pq.read_table(resolve_path("builtin:samples/prompts.parquet"))
    for name in ("prompts.parquet", "data.parquet"):
        pq.write_table(prompts, cwd / name)
    shutil.copy(resolve_path("builtin:samples/reviews.parquet"), cwd / "reviews.parquet")
    chats = [[{"role": "user", "content": f"hello {i}"}] for i in range(4)]
    write_parquet(cwd / "chats.parquet", {"messages": chats})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    write_jsonl(
        cwd / "requests.jsonl",
        [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            for i in range(3)
        ],
    )
    shutil.copytree(ROOT / "jobs", cwd / "jobs")


def _fast(args: list[str], model: Path) -> list[str]:
    """args with the tiny model for a --model path, and few rows and tokens for a run."""
    args = [
        str(model) if prev == "--model" else a for prev, a in zip(["", *args], args, strict=False)
    ]
    if args[:1] == ["run"] and "--help" not in args:
        args += ["--limit", "12", "--device", "cpu", "--no-compile", "--quiet"]
        if "--task" not in args:
            args += ["--max-new-tokens", "4"] if "--max-new-tokens" not in args else []
    return args


def _labels(args: list[str], cwd: Path) -> set[str] | None:
    """The labels a labeling command may write: its --choice, or its job spec's (a free-text
    labeling spec: the sentiments); None for other commands."""
    if "--choice" in args:
        return {s.strip() for s in args[args.index("--choice") + 1].split(",")}
    spec = next((a for a in args if a.endswith(".yaml")), None)
    if spec is None or "label_sentiment" not in spec:
        return None
    values = yaml.safe_load((cwd / spec).read_text())
    return {s.strip() for s in values.get("choice", SENTIMENTS)}


def _output(args: list[str], cwd: Path) -> Path:
    if "-o" in args:
        return cwd / args[args.index("-o") + 1]
    spec = next(a for a in args if a.endswith(".yaml"))
    return cwd / yaml.safe_load((cwd / spec).read_text())["output"]


def _shards(args: list[str], model: Path) -> None:
    """What `batchgen slurm SPEC --shards 2 ... -- RUN FLAGS` would leave: each task's shard
    directory."""
    flags = args[args.index("--") + 1 :] if "--" in args else []
    for i in range(2):  # --shard writes OUT/shard-0000I-of-00002, as the array's tasks do
        run_cli(*_fast(["run", args[1], *flags, "--shard", f"{i}/2"], model))


def test_every_readme_command_runs(tmp_path, model, monkeypatch):
    commands = readme_commands()
    assert len(commands) >= 10, commands
    assert any("--choice" in c for c in commands)  # a labeling example is among them
    monkeypatch.chdir(tmp_path)
    _inputs(tmp_path)
    ran, skipped = [], []
    for cmd in commands:
        args = cmd[1:]
        why = next((r for w, r in SKIP.items() if w in cmd), None)
        if why is not None:
            skipped.append((shlex.join(cmd), why))
            if args[0] == "slurm":  # its array's two tasks, as shards, for `merge` to combine
                _shards(args, model)
            continue
        for d in {_output(args, tmp_path)} if args[0] == "run" and "--help" not in args else ():
            shutil.rmtree(d, ignore_errors=True)  # the README's commands share out/
        run_cli(*_fast(args, model))
        ran.append(shlex.join(cmd))
        labels = _labels(args, tmp_path)
        if labels is not None:
            out = _output(args, tmp_path)
            texts = [r["generated_text"] for r in pq.read_table(out).to_pylist()]
            assert texts and {t.strip() for t in texts} <= labels, (cmd, texts)
            assert "--choice" not in args or set(texts) <= labels, (cmd, texts)  # as written
    assert len(skipped) == 2, skipped  # slurm and -tp 4
    # the sharded label job, merged, reads as its rows once (issue 38 item 3: 400 for 200)
    sharded = pq.read_table(tmp_path / "out" / "label_8").column("id").to_pylist()
    assert len(sharded) == len(set(sharded)) == 12, sharded
    print(json.dumps({"ran": ran, "skipped": skipped}, indent=1))
