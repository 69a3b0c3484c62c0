"""The llama.cpp script for the same job: a baseline of scripts/bench.py, run as a whole
process (load, tokenize, generate, write), set up the way llama.cpp runs best on a CPU.

    LCPY=/path/to/llama.cpp-venv/bin/python
    $LCPY scripts/llamacpp_baseline.py MODEL_DIR --convert-only
    $LCPY scripts/llamacpp_baseline.py MODEL_DIR data.parquet out.parquet --slots 32

llama.cpp (llama-cpp-python, built from its sdist with GGML_NATIVE) lives in its own virtual
environment, so scripts/bench.py runs this script with `--lcpp-python`; the recipe is in
docs/benchmarks.md. The checkpoint is converted once into MODEL_DIR-gguf-f32/model.gguf beside
it by the sdist's own vendor/llama.cpp/convert_hf_to_gguf.py (`--outtype f32`; looked for in
the environment's prefix, where the recipe unpacks it, or --converter), reconverted when the
checkpoint's files change; bench.py calls --convert-only before it times anything. The GGUF
carries no tokenizer (the converter's own vocabulary-less mode, `tokenizer.ggml.model = none`,
with `llama.vocab_size`): rows go in pre-tokenized by transformers' tokenizer, as every engine
of the benchmark gets them, so llama.cpp's BPE pre-tokenizer check, which refuses the bench's
word-level tokenizer, has nothing to check.

The engine is the low-level API the way llama-server and llama.cpp's examples/parallel drive
it: one context, `--slots` sequences (`n_seq_max`) in one unified KV cache (`kv_unified`, F32
keys and values), flash attention on, every core, one `llama_decode` a step whose batch holds
each decoding slot's last token, then prompt chunks of the slots still prefilling, up to
`n_batch` tokens. Greedy: argmax over `llama_get_logits`, exactly max_new_tokens a row, EOS
generated and decoding goes on (the same computation as batchgen's --ignore-eos). A slot
whose row is done takes the next row (input order) at once.

Prompt reuse, as llama-server's `cache_prompt` plus examples/parallel's shared system prompt:
a slot keeps its last prompt's cells; a new row starts from the longest prefix it shares with
any slot's cached prompt, its own kept cells (`llama_memory_seq_rm` of the rest) or another
slot's (`llama_memory_seq_cp`: in a unified cache the cells are shared, not copied). The next
row waits a step when a slot still prefilling will have a longer shared prefix than is
cached now, so a shared instruction (the labeling workload's ~500 tokens) is computed once,
not once a slot.
Writes id, token_ids, text as hf_baseline.py does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from bench_workloads import built_beside, write_baseline_output

GGUF = "model.gguf"

# The converter as it is, with the model class's vocabulary writer swapped for the converter's
# own `_set_vocab_none`; the vendored gguf-py first on the path, as the converter puts it.
_CONVERT = """import json, runpy, sys
from pathlib import Path
conv, model, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
sys.path[:0] = [str(conv.parent), str(conv.parent / "gguf-py")]
from conversion import get_model_class
cls = get_model_class(json.loads((model / "config.json").read_text())["architectures"][0])
cls.set_vocab = cls._set_vocab_none
sys.argv = [str(conv), str(model), "--outtype", "f32", "--outfile", out]
runpy.run_path(str(conv), run_name="__main__")
"""


def converted(model_dir: Path, converter: Path) -> Path:
    """model_dir's GGUF file (f32 weights, no tokenizer), converted on first use."""
    if not converter.is_file():
        raise SystemExit(f"no converter at {converter}: unpack the sdist's vendor/llama.cpp there")

    def convert(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        cmd = [sys.executable, "-c", _CONVERT, str(converter), str(model_dir), str(tmp / GGUF)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    return built_beside(model_dir, "gguf-f32", "gguf_source.json", convert) / GGUF


def context(gguf: Path, slots: int, cells: int, n_batch: int, threads: int):
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(gguf).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cp = L.llama_context_default_params()
    cp.n_ctx = cells
    cp.n_batch = n_batch
    cp.n_seq_max = slots
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create its context")
    return model, ctx, L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))


class Batch:
    """A llama_batch over numpy arrays, refilled every step: one sequence id a token."""

    def __init__(self, cap: int) -> None:
        self.token, self.pos, self.seq = (np.zeros(cap, np.int32) for _ in range(3))
        self.n_seq = np.ones(cap, np.int32)
        self.out = np.zeros(cap, np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data  # seq_id[i] points at seq[i]
        self.seq_ptrs = (i32 * cap)(*(ctypes.cast(base + 4 * i, i32) for i in range(cap)))
        self.n = 0

    def add(self, tokens: np.ndarray, start: int, seq: int, output: bool) -> None:
        """tokens at positions start.. of seq; the logits of the last one wanted if output."""
        i, k = self.n, len(tokens)
        self.token[i : i + k] = tokens
        self.pos[i : i + k] = np.arange(start, start + k)
        self.seq[i : i + k] = seq
        self.out[i : i + k] = 0
        self.out[i + k - 1] = output
        self.n += k

    def struct(self):
        import llama_cpp as L

        i32 = ctypes.POINTER(ctypes.c_int32)
        return L.llama_batch(
            n_tokens=self.n,
            token=self.token.ctypes.data_as(i32),
            embd=None,
            pos=self.pos.ctypes.data_as(i32),
            n_seq_id=self.n_seq.ctypes.data_as(i32),
            seq_id=ctypes.cast(self.seq_ptrs, ctypes.POINTER(i32)),
            logits=self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )


@dataclass(slots=True)
class Slot:
    seq: int
    row: int | None = None  # the row it generates for; None: idle
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    done: int = 0  # prompt tokens in its cells (positions 0..done-1)


def shared(a: np.ndarray, b: np.ndarray) -> int:
    """The length of a's and b's common prefix."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def generate(ctx, n_vocab: int, prompts, news: list[int], slots: int, n_batch: int):
    import llama_cpp as L

    mem = L.llama_get_memory(ctx)
    pool = [Slot(seq) for seq in range(slots)]
    queue = deque(range(len(prompts)))
    out: list[list[int]] = [[] for _ in prompts]
    batch = Batch(n_batch)

    def take(s: Slot) -> bool:
        """Start the queue's next row on idle slot s from the longest cached prefix; False
        (the row waits) when a slot still prefilling will offer a longer one."""
        row = queue[0]
        p = prompts[row]
        cap = len(p) - 1  # at least one token to compute: the first output's logits
        cached = [(min(shared(o.prompt[: o.done], p), cap), o) for o in pool]
        best, donor = max(cached, key=lambda c: (c[0], c[1] is s))
        coming = (shared(o.prompt, p) for o in pool if o.row is not None and o.done < len(o.prompt))
        if min(max(coming, default=0), cap) > best:
            return False
        queue.popleft()
        if donor is s:
            L.llama_memory_seq_rm(mem, s.seq, best, -1)
        else:
            L.llama_memory_seq_rm(mem, s.seq, -1, -1)
            L.llama_memory_seq_cp(mem, donor.seq, s.seq, 0, best)
        s.row, s.prompt, s.done = row, p, best
        return True

    while True:
        for s in pool:
            if s.row is None and queue and not take(s):
                break
        live = [s for s in pool if s.row is not None]
        if not live:
            return out
        batch.n = 0
        emit = [s for s in live if s.done == len(s.prompt)]  # decoding: feed the last token
        for s in emit:
            o = out[s.row]
            batch.add(np.asarray(o[-1:], np.int32), len(s.prompt) + len(o) - 1, s.seq, True)
        for s in live:
            if s.done < len(s.prompt) and batch.n < n_batch:
                k = min(len(s.prompt) - s.done, n_batch - batch.n)
                last = s.done + k == len(s.prompt)
                batch.add(s.prompt[s.done : s.done + k], s.done, s.seq, last)
                s.done += k
                emit += [s] if last else []
        rc = L.llama_decode(ctx, batch.struct())
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (1: no room in the KV cache)")
        # (outputs, vocab): the rows asked for, in batch order
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(emit), n_vocab))
        for s, t in zip(emit, logits.argmax(axis=1).tolist(), strict=True):
            out[s.row].append(t)
            if len(out[s.row]) == news[s.row]:
                s.row = None


def cells_needed(prompts, news: list[int], slots: int, n_batch: int) -> int:
    """KV cells for the worst case: the slots' largest rows at once, none shared."""
    sizes = sorted(len(p) + n for p, n in zip(prompts, news, strict=True))
    return -(-(sum(sizes[-slots:]) + n_batch) // 256) * 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("input", nargs="?")
    p.add_argument("output", nargs="?")
    p.add_argument("--slots", type=int, default=32, help="sequences at once (n_seq_max)")
    p.add_argument("--n-batch", type=int, default=2048, help="tokens a llama_decode at most")
    p.add_argument("--threads", type=int, default=None, help="default: every core")
    p.add_argument(
        "--converter",
        type=Path,
        default=Path(sys.prefix) / "llama.cpp" / "convert_hf_to_gguf.py",
        help="the sdist's vendor/llama.cpp/convert_hf_to_gguf.py (default: in this venv)",
    )
    p.add_argument("--convert-only", action="store_true", help="convert (if needed) and exit")
    a = p.parse_args()
    if a.convert_only:
        print(converted(a.model_dir, a.converter))
        return
    if a.input is None or a.output is None:
        p.error("INPUT and OUTPUT are required unless --convert-only")
    t0 = time.perf_counter()
    import transformers

    # llama.cpp's warnings and errors only: llama-cpp-python's log callback maps ggml's WARN
    # to ERROR (and INFO to WARNING), as its Llama(verbose=False) does
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    tok = transformers.AutoTokenizer.from_pretrained(a.model_dir)
    table = pq.read_table(a.input)
    texts = table.column("prompt").to_pylist()
    prompts = [np.asarray(tok(t)["input_ids"], np.int32) for t in texts]
    news = table.column("max_new_tokens").to_pylist()
    cells = cells_needed(prompts, news, a.slots, a.n_batch)
    gguf = converted(a.model_dir, a.converter)
    _, ctx, n_vocab = context(gguf, a.slots, cells, a.n_batch, a.threads or os.cpu_count())
    vocab = json.loads((a.model_dir / "config.json").read_text())["vocab_size"]
    if n_vocab != vocab:
        raise SystemExit(f"{gguf}: {n_vocab} logits a token, the checkpoint has {vocab}")
    ids = generate(ctx, n_vocab, prompts, news, a.slots, a.n_batch)
    write_baseline_output(a.output, table.column("id"), ids, tok)
    print(f"llama.cpp {a.slots} slots: {len(ids)} rows in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
