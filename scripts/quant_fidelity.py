"""How much each quantization scheme changes a model's output, against the float model.

    python scripts/quant_fidelity.py                       # the embedded default model, CPU
    python scripts/quant_fidelity.py --model DIR --device cuda --dtype bfloat16 --out fid.json

For none and each available (backend, method), on one fixed text and one prompt set:

- ppl: perplexity of the fixed text, fed token by token through the decode path (the
  paged KV cache, one token per row per step, all rows decoding together), and its change
  relative to the float model;
- top1: teacher-forced greedy agreement, the share of the text's positions where the
  quantized model's argmax equals the float model's;
- greedy: free-running agreement, the share of generated tokens (greedy, EOS ignored)
  equal to the float model's at the same position; one early flip changes the rest of
  its row, so this is the noisier measure;
- weights: bytes of all parameters, and of the quantized decoder linears alone.

The fixed text is the held-out sample rows (batchgen/assets/samples) written in the
formats the default model was trained on. Runs eagerly: compiling changes no numerics
that matter here and would cost minutes per scheme on a small CPU. Prints a markdown
table; --out writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchgen.engine.config import EngineConfig  # noqa: E402
from batchgen.engine.sequence import SamplingParams  # noqa: E402
from batchgen.errors import QuantUnavailableError  # noqa: E402
from batchgen.job.model_spec import DEFAULT_MODEL  # noqa: E402
from batchgen.job.tokenizer import load_tokenizer  # noqa: E402
from batchgen.llm import LLM  # noqa: E402
from batchgen.model.attention.step import DecodeGroup, StepAttention  # noqa: E402
from batchgen.model.families.transformer import RMSNorm, Transformer  # noqa: E402
from batchgen.quant import available, tensor_bytes  # noqa: E402

SAMPLES = ROOT / "batchgen" / "assets" / "samples"
EOS = "<|endoftext|>"


def fixed_text() -> list[str]:
    """Held-out sample rows in the default model's three training formats."""
    reviews = pq.read_table(SAMPLES / "reviews.parquet").to_pylist()
    topics = pq.read_table(SAMPLES / "topics.parquet").to_pylist()
    parts = [f"Review: {r['text']}\nSentiment: {r['label']}{EOS}" for r in reviews[:24]]
    parts += [f"Review: {r['text']}\nSummary: {r['summary']}{EOS}" for r in reviews[24:40]]
    parts += [f"Text: {r['text']}\nTopic: {r['label']}{EOS}" for r in topics[:16]]
    return parts


def prompt_set(n: int) -> list[str]:
    reviews = pq.read_table(SAMPLES / "reviews.parquet").to_pylist()[100 : 100 + n]
    return [f"Review: {r['text']}\nSummary:" for r in reviews]


def text_rows(tokenizer, row_len: int) -> torch.Tensor:
    """The fixed text's token ids cut into rows of row_len, (B, row_len)."""
    ids = [i for part in fixed_text() for i in tokenizer(part)["input_ids"]]
    n = len(ids) // row_len
    return torch.tensor(ids[: n * row_len]).view(n, row_len)


@torch.inference_mode()
def teacher_forced(
    model: Transformer, rows: torch.Tensor, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed rows (B, T) one token per step through the paged cache, the B rows as one
    batch of decodes; return the log-prob of each next token (B, T-1) and the argmax at
    each step (B, T-1). Replaces the model's caches: run it before the LLM's engine
    allocates its own (its first generate)."""
    device = model.embed.weight.device
    rows = rows.to(device)
    b, t = rows.shape
    n_blocks = -(-t // block_size)
    model.setup_caches(b * n_blocks, block_size)
    tables = torch.arange(b * n_blocks, device=device).view(b, n_blocks)  # row r: its own blocks
    index = torch.arange(b, device=device)
    logps, argmax = [], []
    for i in range(t - 1):
        pos = torch.full((b,), i, dtype=torch.long, device=device)
        blk, off = divmod(i, block_size)
        step = StepAttention(
            slots=tables[:, blk] * block_size + off,
            num_decodes=b,
            decodes=(DecodeGroup(0, tables[:, : blk + 1], pos + 1),),
        )
        logits = model(rows[:, i], pos, step, index).log_softmax(-1)  # (B, V)
        logps.append(logits.gather(-1, rows[:, i + 1, None])[:, 0])
        argmax.append(logits.argmax(-1))
    return torch.stack(logps, 1), torch.stack(argmax, 1)


def target_bytes(model: Transformer) -> int:
    """Bytes of the decoder blocks' linear weights (what quantization replaces), in
    whatever modules hold them (a float CPU model's packed layers split a gated MLP's w_in)."""
    return sum(
        tensor_bytes(m.weight)
        for block in model.layers
        for m in block.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and not isinstance(m, (RMSNorm, nn.LayerNorm))
    )


def engine_config(prompts: list[list[int]], new_tokens: int, block_size: int = 16) -> EngineConfig:
    """All prompts in flight at once, in a KV pool of exactly what they need (on a GPU the
    default pool would take most of the free memory, once per scheme)."""
    blocks = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts)
    return EngineConfig(
        max_num_seqs=max(1, len(prompts)),
        block_size=block_size,
        kv_cache_tokens=(blocks + 2) * block_size,  # + the scratch block, + 1 to spare
    )


def measure(args, method: str, backend: str, rows, prompts: list[list[int]]) -> dict:
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        compile=False,
        engine=engine_config(prompts, args.new_tokens),
        quantize=method,
        quant_backend=backend,
    )
    # Teacher-forced first: it sets up its own caches, which the engine's first generate
    # then replaces with its pool.
    logp, top1 = teacher_forced(llm.model, rows, llm.config.block_size)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    gen = [c.token_ids for c in llm.generate(prompts, params)]
    # All parameters, tied ones once: the LLM's model is the one the runner uses.
    total = sum(tensor_bytes(p) for p in llm.model.parameters())
    return dict(
        method=method,
        backend=backend if method != "none" else None,
        scheme=llm.quant.to_dict(),
        nll=float(-logp.mean()),
        top1=top1.cpu(),
        gen=gen,
        weight_bytes=total,
        linear_bytes=target_bytes(llm.model),
        seconds=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="model directory (default: embedded)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backends", default="torchao,quanto")
    p.add_argument("--methods", default="int8,int4,fp8")
    p.add_argument("--row-len", type=int, default=128, help="tokens per row of the fixed text")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.manual_seed(0)

    tokenizer = load_tokenizer(Path(args.model))
    rows = text_rows(tokenizer, args.row_len)
    prompts = [tokenizer(t)["input_ids"] for t in prompt_set(args.n_prompts)]

    ref = measure(args, "none", "auto", rows, prompts)
    results = []
    for backend in args.backends.split(","):
        for method in args.methods.split(","):
            try:
                r = measure(args, method, backend, rows, prompts)
            except QuantUnavailableError as e:
                print(f"skip {backend} {method}: {e}", file=sys.stderr)
                continue
            results.append(r)
    out = []
    for r in [ref, *results]:
        same = sum(
            a == b
            for g, f in zip(r["gen"], ref["gen"], strict=True)
            for a, b in zip(g, f, strict=True)
        )
        out.append(
            dict(
                method=r["method"],
                backend=r["backend"],
                scheme=r["scheme"],
                ppl=math.exp(r["nll"]),
                ppl_delta_pct=100 * (math.exp(r["nll"] - ref["nll"]) - 1),
                top1_agreement=float((r["top1"] == ref["top1"]).float().mean()),
                greedy_agreement=same / sum(len(g) for g in ref["gen"]),
                weight_bytes=r["weight_bytes"],
                linear_bytes=r["linear_bytes"],
                seconds=round(r["seconds"], 2),
            )
        )

    text_tokens = rows.numel()
    print(
        f"\nmodel {args.model}, {args.device} {args.dtype}; fixed text {text_tokens} tokens "
        f"({rows.shape[0]} rows of {rows.shape[1]}); {len(prompts)} prompts x "
        f"{args.new_tokens} greedy tokens. Available on {args.device}: "
        f"{', '.join(available(args.device))}\n"
    )
    print(
        "| backend | method | format | ppl | Δppl | top-1 agree | greedy agree | weights | "
        "linears |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['backend'] or '-'} | {r['method']} | {r['scheme'].get('weight_format') or '-'} "
            f"| {r['ppl']:.4f} | {r['ppl_delta_pct']:+.2f}% | {100 * r['top1_agreement']:.1f}% "
            f"| {100 * r['greedy_agreement']:.1f}% | {r['weight_bytes'] / 2**20:.2f} MiB "
            f"| {r['linear_bytes'] / 2**20:.3f} MiB |"
        )
    if args.out:
        meta = dict(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            text_tokens=text_tokens,
            prompts=len(prompts),
            new_tokens=args.new_tokens,
            torch=torch.__version__,
        )
        Path(args.out).write_text(json.dumps(dict(meta=meta, results=out), indent=2))
    return out


if __name__ == "__main__":
    main()
