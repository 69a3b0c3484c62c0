"""A stored INT4 checkpoint against its bf16 model on the CPU: peak RSS while loading, and
greedy decode speed, each in a fresh process. docs/quantization.md's INT4 figures.

    python scripts/bench_stored_int4.py make /tmp/int4       # bf16 Llama (334 M) + its GPTQ
    python scripts/bench_stored_int4.py load /tmp/int4/gptq  # weights, peak RSS above start, MiB
    for i in 1 2; do for m in bf16 gptq; do                   # A B A B
        python scripts/bench_stored_int4.py speed /tmp/int4/$m; done; done

The GPTQ checkpoint is written by tests/int4_checkpoints.py (v1, symmetric, groups of 128,
round to nearest), from random weights: for memory and speed, not for quality.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make(root: Path) -> None:
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from int4_checkpoints import write_int4

    cfg = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "bf16")
    for f in (ROOT / "batchgen/assets/default-model").glob("tokenizer*.json"):
        shutil.copy(f, root / "bf16" / f.name)
    write_int4(root / "bf16", root / "gptq", "gptq", group=128, sym=True)


def load(model: Path) -> dict:
    from batchgen.model.checkpoint.loader import load_model
    from batchgen.model.memory import weight_bytes
    from batchgen.model.quiet_import import quiet_torchao

    with quiet_torchao():
        import torchao  # noqa: F401 - in the baseline, as a stored checkpoint needs it
    _warm_up()
    before, linux = _reset_peak()
    m = load_model(model, dtype=torch.bfloat16)
    peak = _status("VmHWM") if linux else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mib = 2**20
    return dict(model=model.name, weights_mib=weight_bytes(m) / mib, peak_mib=(peak - before) / mib)


def _warm_up() -> None:
    """The runtime in the baseline: one small layer unpacked and packed as a load does, so the
    kernels' code pages and thread pools (~10-30 MiB, whatever the model) are not counted as
    the load's."""
    from batchgen.model.checkpoint.int4_tensors import int4_weight, nibbles

    d = nibbles(torch.ones(256, 32, dtype=torch.int32)).reshape(256, 256)
    int4_weight(d - 8, torch.ones(256, 2), torch.bfloat16)


def _reset_peak() -> tuple[int, bool]:
    """(the process's resident bytes now, whether its peak was reset to them). Importing torch
    peaks above where it settles, so the load's peak is read as VmHWM after resetting it
    (Linux: /proc/self/clear_refs). Not ru_maxrss: it keeps the peak from before execve, the
    size of the parent that forked this process (a test run's ~1 GB). Elsewhere: ru_maxrss,
    and the peak so far as the start."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS"), True
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, False


def _status(key: str) -> int:
    """A /proc/self/status figure (kB) in bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(ln.split()[1]) for ln in lines if ln.startswith(key + ":")) * 1024


def speed(model: Path, rows: int = 8, new: int = 32) -> dict:
    from batchgen.engine.sequence import SamplingParams
    from batchgen.llm import LLM

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1300, (32,), generator=g).tolist() for _ in range(rows)]
    llm = LLM(model, device="cpu", dtype="bfloat16")
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in out)
    return dict(model=model.name, tokens=tokens, seconds=round(seconds, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["make", "load", "speed"])
    p.add_argument("path", type=Path)
    a = p.parse_args()
    if a.what == "make":
        make(a.path)
    else:
        print(json.dumps((load if a.what == "load" else speed)(a.path)))


if __name__ == "__main__":
    main()
