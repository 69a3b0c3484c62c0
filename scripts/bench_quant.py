"""Decode speed of quantized weights against the unquantized model, compiled, same run.

    python scripts/bench_quant.py                                   # embedded model, CPU
    python scripts/bench_quant.py --random-llama 1024 --layers 4    # a weight-bound size
    python scripts/bench_quant.py --device cuda --dtype bfloat16 --random-llama 2048 --out q.json

Each configuration (none, then every backend x method asked for and available on the
device) is built once with `LLM(..., compile=True)`, its KV pool allocated (a one-token
generate: allocating resets dynamo, so every pool exists before any graph is compiled),
then warmed at every batch size, so all decode graphs are compiled before timing. Timing
then runs in rounds, each round visiting every (configuration, batch size) once, and
reports the median round: on a shared machine, load that comes and goes then hits every
configuration alike. A cell is decode tokens/s (rows decoded in the decode-only steps /
those steps' seconds, from the engine's step reports, which exclude compilation), and its
ratio to `none` at the same batch size. `recompiles` counts graphs compiled during the
timed rounds; it should be 0.

Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models

from batchgen.engine.config import EngineConfig  # noqa: E402
from batchgen.engine.sequence import Request, SamplingParams  # noqa: E402
from batchgen.errors import QuantUnavailableError  # noqa: E402
from batchgen.job.model_spec import DEFAULT_MODEL  # noqa: E402
from batchgen.llm import LLM  # noqa: E402
from batchgen.quant import weight_bytes  # noqa: E402


def random_llama(hidden: int, layers: int, root: Path) -> Path:
    from tiny_models import save_tiny_model

    return save_tiny_model(
        "llama",
        root / f"llama-{hidden}x{layers}",
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4 // 128 * 128,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=1024,
    )


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (batch, length), generator=g).tolist()


def engine_config(args, batches: list[int]) -> EngineConfig:
    """The largest batch decodes as one batch, after a single prefill step, in a pool that
    holds it (without the prefix cache: every call's work is the same)."""
    bs = 16
    row_blocks = -(-(args.prompt_len + args.new_tokens) // bs)
    return EngineConfig(
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
        block_size=bs,
        kv_cache_tokens=(max(batches) * row_blocks + 1) * bs,  # + the scratch block
        prefix_caching=False,
    )


def generate(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> list:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    requests = [Request(i, p, params) for i, p in enumerate(prompts(batch, prompt_len, seed))]
    reports = list(llm.engine.generate(requests))
    errors = [c.error for r in reports for c in r.finished if c.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed, e.g. {errors[0]}")
    return reports


def decode_rate(llm: LLM, batch: int, args, seed: int) -> tuple[float, int]:
    """Decode tokens/s of one generate call of `batch` rows; and graphs compiled during it."""
    from torch._dynamo.utils import counters

    g0 = counters["stats"]["unique_graphs"]
    decode = [
        r
        for r in generate(llm, batch, args.prompt_len, args.new_tokens, seed)
        if not r.prefill and r.decode_rows
    ]
    rows, secs = sum(r.decode_rows for r in decode), sum(r.seconds for r in decode)
    return rows / secs if secs else 0.0, counters["stats"]["unique_graphs"] - g0


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument(
        "--random-llama",
        type=int,
        metavar="HIDDEN",
        help="instead of --model, a random Llama of this width",
    )
    p.add_argument("--layers", type=int, default=4, help="layers of --random-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backends", default="torchao,quanto")
    p.add_argument("--methods", default="int8,int4")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    import torch._dynamo.config as dynamo_config

    # Every configuration keeps its graphs for the interleaved rounds: room for all of them.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 512)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 512)

    tmp = tempfile.TemporaryDirectory()
    model = (
        random_llama(args.random_llama, args.layers, Path(tmp.name))
        if args.random_llama
        else Path(args.model)
    )
    engine = engine_config(args, batches)
    configs = [("none", "auto")] + [
        (m, b) for b in args.backends.split(",") for m in args.methods.split(",")
    ]
    llms: dict[tuple[str, str], LLM] = {}
    info: dict[tuple[str, str], dict] = {}
    built: dict[tuple[str, str], float] = {}
    for method, backend in configs:
        t0 = time.perf_counter()
        try:
            llm = LLM(
                model,
                dtype=args.dtype,
                device=args.device,
                compile=True,
                engine=engine,
                quantize=method,
                quant_backend=backend,
            )
        except QuantUnavailableError as e:
            print(f"skip {backend} {method}: {e}", file=sys.stderr)
            continue
        # Allocates the KV pool (which resets dynamo) with a prefill-only call: no graph yet.
        generate(llm, 1, args.prompt_len, 1, seed=0)
        key = (method, llm.quant.backend.value if llm.quant.enabled else "-")
        llms[key] = llm
        built[key] = time.perf_counter() - t0
    for key, llm in llms.items():
        t0 = time.perf_counter()
        for b in batches:  # warm-up: compiles decode at each batch size
            decode_rate(llm, b, args, seed=0)
        info[key] = dict(
            scheme=llm.quant.to_dict(),
            weight_bytes=weight_bytes(llm.model),
            warmup_s=round(built[key] + time.perf_counter() - t0, 1),
            graphs=llm.runner.graph.graphs if llm.runner.graph is not None else 0,
        )
        print(f"built {key} in {info[key]['warmup_s']} s", file=sys.stderr, flush=True)

    rates: dict[tuple, list[float]] = {}
    recompiles: dict[tuple, int] = {}
    for r in range(args.rounds):
        for key, llm in llms.items():
            for b in batches:
                rate, new_graphs = decode_rate(llm, b, args, seed=r + 1)
                rates.setdefault((*key, b), []).append(rate)
                recompiles[(*key, b)] = recompiles.get((*key, b), 0) + new_graphs

    any_llm = next(iter(llms.values()))
    rows = []
    for key in llms:
        for b in batches:
            rate = statistics.median(rates[(*key, b)])
            base = statistics.median(rates[("none", "-", b)])
            rows.append(
                dict(
                    method=key[0],
                    backend=key[1],
                    batch=b,
                    tokens_per_s=rate,
                    ratio=rate / base,
                    recompiles=recompiles[(*key, b)],
                    rounds=[round(x, 1) for x in rates[(*key, b)]],
                    **info[key],
                )
            )

    print(
        f"\nmodel {model}, {any_llm.device} {str(any_llm.dtype).removeprefix('torch.')}, "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, median of "
        f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    print("| backend | method | format | weights | batch | decode tok/s | vs none | recompiles |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['method']} | {r['scheme'].get('weight_format') or '-'} "
            f"| {r['weight_bytes'] / 2**20:.1f} MiB | {r['batch']} | {r['tokens_per_s']:.0f} "
            f"| {r['ratio']:.2f}x | {r['recompiles']} |"
        )
    if args.out:
        meta = dict(
            model=str(model),
            device=str(any_llm.device),
            dtype=str(any_llm.dtype),
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            rounds=args.rounds,
            threads=torch.get_num_threads(),
            torch=torch.__version__,
        )
        Path(args.out).write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
