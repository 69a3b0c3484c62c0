"""Shared helpers for the tests: write real input files, run the real CLI, read outputs; random
token prompts and transformers' greedy rows, the reference for exactness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from click.testing import CliRunner, Result

from batchgen.cli import main
from batchgen.data.layout import JOB_FILE, STATS_FILE, SUCCESS_FILE
from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM

ROOT = Path(__file__).resolve().parents[1]

# Eager with a small cache: the tiny models then run a job in about a second. Error rows are
# what many tests are about, so the exit-1 gate on their share is off; test_user2_failures.py
# tests it (DEVICE_FLAGS: without that).
DEVICE_FLAGS = ("--device", "cpu", "--no-compile", "--kv-cache-tokens", "4096")
EAGER = (*DEVICE_FLAGS, "--max-error-rate", "1")
FAST = (*EAGER, "--quiet")

BASE_COLUMNS = ["generated_text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]

# Short prompts in the tiny tokenizer's corpus, of a few different token lengths.
PROMPTS = [
    "the quick brown fox",
    "label the sentiment of this review: great product",
    "a static cache keeps every shape fixed",
    "summarise the text in one sentence.",
    "batch inference sorts prompts by length and packs them into buckets.",
    "the lazy dog",
    "great product, would buy again",
    "so the compiler sees one graph",
]


def prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]


def write_parquet(path: Path, columns: dict[str, list], **kw) -> Path:
    pq.write_table(pa.table(columns), path, **kw)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(*args: Any, exit_code: int | None = 0) -> Result:
    """`batchgen ARGS` in-process; checks the exit code unless exit_code is None."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if exit_code is not None:
        assert result.exit_code == exit_code, (
            f"exit {result.exit_code}, wanted {exit_code}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def run_job(source: Any, out: Any, model: Any, *flags: Any, exit_code: int | None = 0) -> Result:
    """`batchgen run SOURCE -o OUT --model MODEL` with the fast test flags, then FLAGS."""
    return run_cli("run", source, "-o", out, "--model", model, *FAST, *flags, exit_code=exit_code)


def run_plan(source: Any, model: Any, *flags: Any, exit_code: int | None = 0) -> Result:
    """`batchgen plan SOURCE --model MODEL FLAGS`."""
    return run_cli("plan", source, "--model", model, *flags, exit_code=exit_code)


def prompt_file(tmp_path: Path, n: int, **columns: list) -> Path:
    """tmp_path/in.parquet, the input most tests run: a `prompt` column of prompts(n), then
    any more columns (regex=[...])."""
    return write_parquet(tmp_path / "in.parquet", {"prompt": prompts(n), **columns})


def assert_live_equal(got: list[list[int]], want: list[list[int]]) -> None:
    """got equals want, a live reference: more than half its rows vary (not one token over)."""
    assert got == want
    assert sum(len(set(row)) > 2 for row in want) > len(want) // 2, want


def assert_pressed(llm: LLM) -> None:
    """The run preempted rows and hit the prefix cache (a tight engine's), and gave every
    block back."""
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.pool.hits > 0
    assert sched.pool.num_free == sched.pool.num_usable


def decoder_config(
    model_type: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, **rest
) -> dict[str, Any]:
    """A decoder's config.json as a dict: its usual sizes under their keys, and rest."""
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate)
    sizes.update(num_hidden_layers=layers, num_attention_heads=heads)
    return dict(model_type=model_type, **sizes, **rest)


def cached(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """key -> make(key), made at the first ask and kept (fixtures of models made on demand)."""
    made: dict[Any, Any] = {}

    def get(key: Any) -> Any:
        if key not in made:
            made[key] = make(key)
        return made[key]

    return get


def cpu_llm(model_dir: Any, compile: bool = False, **kw: Any) -> LLM:
    """The LLM the tests run the tiny models in: float32 on the CPU, eager by default."""
    return LLM(model_dir, dtype="float32", device="cpu", compile=compile, **kw)


def assert_one_line_error(r: Result | str, *words: str) -> None:
    """The CLI failed (r: its result, or a process's stderr) with no traceback and a last line
    "Error: ..." holding every word."""
    stderr = r if isinstance(r, str) else r.stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert lines and lines[-1].startswith("Error: "), stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])


def cli_command(*args: Any) -> list[str]:
    return [sys.executable, "-m", "batchgen.cli", *map(str, args)]


def start_cli(*args: Any) -> subprocess.Popen:
    """The CLI as a separate process (for signals), stdout/stderr captured."""
    return subprocess.Popen(
        cli_command(*args),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_for_part(out: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll until the first complete part file exists (the process must still be running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(out.glob("part-*.parquet")):
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"the job ended (exit {proc.returncode}) before writing a part:\n"
                + proc.stderr.read()
            )
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no part file in {out} after {timeout} s")


def read_output(out: Path) -> pa.Table:
    """Every part file of an output directory, in part order."""
    parts = sorted(out.glob("part-*.parquet"))
    assert parts, f"no part files in {out}: {sorted(p.name for p in out.iterdir())}"
    return pa.concat_tables(pq.read_table(p) for p in parts)


def rows_by_id(out: Path, id_column: str = "id") -> dict[Any, dict[str, Any]]:
    """Output rows keyed by their id column (`id`: row numbers, or an input column of that
    name); fails on a duplicate id."""
    rows = read_output(out).to_pylist()
    ids = [r[id_column] for r in rows]
    dupes = sorted({i for i in ids if ids.count(i) > 1}, key=str)
    assert not dupes, f"ids written more than once: {dupes}"
    return {r[id_column]: r for r in rows}


def read_stats(out: Path) -> dict[str, Any]:
    return json.loads((out / STATS_FILE).read_text())


def read_job(out: Path) -> dict[str, Any]:
    """The output's job fingerprint (what a rerun is compared with)."""
    return json.loads((out / JOB_FILE).read_text())


def success(out: Path) -> bool:
    """The output (a run, a shard or a merge) is marked complete."""
    return (out / SUCCESS_FILE).exists()


def listing(out: Path) -> list[str]:
    """Every file under out, as sorted paths relative to it (`.batchgen/job.json`, ...)."""
    return sorted(p.relative_to(out).as_posix() for p in Path(out).rglob("*") if p.is_file())


def random_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of token ids in [2, 500) (no BOS/EOS), one of each length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lens]


# What the tests of pre-quantized checkpoints (both model implementations, dense and MoE)
# generate from: mixed lengths, one a single token, 12 greedy tokens each.
STORED_PROMPTS = random_prompts([3, 11, 6, 17, 1])
STORED_NEW = 12


def stored_tokens(model_dir: Any, **kw: Any) -> list[list[int]]:
    """Greedy tokens of STORED_PROMPTS through an eager CPU engine on model_dir (kw: cpu_llm's)."""
    got = cpu_llm(model_dir, **kw).generate(
        STORED_PROMPTS, SamplingParams(max_new_tokens=STORED_NEW)
    )
    return [c.token_ids for c in got]


def hf_logits(model_dir: Any, row: list[int]) -> torch.Tensor:
    """transformers' float32 logits (len(row), vocab) of row on the checkpoint in model_dir."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf.eval()(torch.tensor([row])).logits[0]


def hf_generate(
    hf, prompts: list[list[int]], max_new: int, pad: int, **generate
) -> list[list[int]]:
    """transformers' batched greedy generate with left padding, on hf's device: each row's
    max_new new tokens (fewer where all rows stop; generate: more of its options)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            **generate,
        )
    return out[:, width:].tolist()


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int, **generate) -> list[list[int]]:
    """transformers' float32 greedy rows (hf_generate) on the CPU, each up to its EOS; generate:
    more of its options (repetition_penalty=1.3)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id or 0
    eos = hf.generation_config.eos_token_id
    rows = hf_generate(hf, prompts, max_new, pad, **generate)
    return [r[: r.index(eos) + 1] if eos in r else r for r in rows]


def make_adapter(base_dir, out_dir, config, seed: int = 0):
    """A PEFT adapter on base_dir with random A and B (peft starts B at zero), saved to out_dir;
    returns the PeftModel."""
    from peft import get_peft_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(hf, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out_dir)
    return model


# Probe source for a fresh process (the malloc setting is the process's): kept_mib() is how
# many MiB of 512 1 MiB blocks, freed last to first, glibc keeps in its heap's top (mallinfo2's
# keepcost): all of them where freed memory is kept, at most its trim threshold where not.
KEPT_MIB_SOURCE = """
import ctypes

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def kept_mib():
    blocks = [libc.malloc(1 << 20) for _ in range(512)]
    for block in reversed(blocks):
        libc.free(block)
    return libc.mallinfo2().keepcost >> 20
"""


def graph_launches(fn: Callable[[], Any]) -> int:
    """cudaGraphLaunch calls while fn runs (the profiler's count): a compiled step on a GPU
    launches its piecewise CUDA graphs, an eager one or one whose graphs were skipped none."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if "cudaGraphLaunch" in e.key)
