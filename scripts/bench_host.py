"""The host's time per engine step, with the device's work taken away.

The engine runs a real scheduler, block pool and model runner over a tiny model whose forward
is a stub: it returns fixed logits from a static buffer (every row's likeliest token is the
same non-EOS token) without reading its inputs. What is left of a step is the host's work a
GPU would wait for: planning the step, packing its inputs and their copy to the device,
sampling's launch and the read of its results, and the scheduler's update. The stub's vocab
is small (--vocab, 1024) so the sampling kernels themselves, device work on a GPU, cost little
here. Decode-only steps (every row past its prompt) are timed; prefill steps are not.

    python scripts/bench_host.py                    # 256 and 1024 sequences, contexts 512 and 8192
    python scripts/bench_host.py --seqs 256 --contexts 512 --steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.params import DecodeParams
from batchgen.engine.sequence import Request
from batchgen.model.config import ModelConfig
from batchgen.model.families.transformer import Transformer

TOKEN = 7  # every row's next token (not EOS, which is 2)


def stub_model(vocab: int, max_positions: int) -> Transformer:
    """A one-layer model whose forward returns static logits and allocates no KV pool."""
    cfg = ModelConfig(
        family=None,
        vocab_size=vocab,
        dim=64,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        intermediate_size=64,
        max_position_embeddings=max_positions,
    )
    model = Transformer(cfg).eval()
    logits = torch.zeros(8192, vocab)
    logits[:, TOKEN] = 1.0

    def forward(tokens, positions, step, logits_index):
        return logits[: logits_index.shape[0]]

    model.forward = forward
    model.setup_caches = lambda num_blocks, block_size: None
    return model


def run(seqs: int, context: int, steps: int, vocab: int, budget: int) -> list[float]:
    """Host seconds of each decode-only step of `seqs` rows of `context` prompt tokens."""
    # rows decode while later rows prefill (in what the decodes leave of the budget): enough
    # new tokens that every row is past its prompt for `steps` steps at the end
    new = steps + -(-seqs * context // max(1, budget - seqs)) + 2
    model = stub_model(vocab, context + new + 16)
    runner = ModelRunner(model, block_size=16)
    cfg = EngineConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        kv_cache_tokens=seqs * (context + new + 16),
        prefix_caching=False,
    )
    engine = Engine(runner, cfg, detokenize=lambda ids: "", eos_ids=(2,))
    params = DecodeParams(max_new_tokens=new, ignore_eos=True)
    requests = [
        Request(i, [3 + (i + p) % 500 for p in range(context)], params) for i in range(seqs)
    ]
    times, last = [], None
    for report in engine.generate(requests):
        now = time.perf_counter()
        decode_only = report.decode_rows == seqs and not report.prefill
        if decode_only and last is not None:
            times.append(now - last)
        last = now
    return times[-steps:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--steps", type=int, default=48, help="new tokens a row (decode steps)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch's threads (1: the host's own thread)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'seqs':>6} {'context':>8} {'host ms/step p50':>17} {'p90':>7} {'steps':>6}")
    for seqs in args.seqs:
        for context in args.contexts:
            t = run(seqs, context, args.steps, args.vocab, args.max_num_batched_tokens)
            q = statistics.quantiles(t, n=10)
            med = statistics.median(t)
            print(f"{seqs:>6} {context:>8} {med * 1e3:>17.2f} {q[8] * 1e3:>7.2f} {len(t):>6}")


if __name__ == "__main__":
    main()
