"""The transformers script a data scientist writes for the same job: the baselines of
scripts/bench.py, run as a whole process (load, tokenize, generate, write).

    python scripts/hf_baseline.py MODEL_DIR data.parquet out.parquet --mode sorted --batch-size 16

Reads `id`, `prompt` and `max_new_tokens` columns; generates exactly max_new_tokens per row
(EOS ignored: generation_config.eos_token_id = None, so EOS can be generated and decoding
goes on, the same computation as batchgen's --ignore-eos); writes id, token_ids, text.

Modes:
- input: `generate` on chunks of batch-size rows in input order, left-padded, each chunk
  run to its longest row's max_new_tokens (what `pipeline(batch_size=N)` does);
- sorted: the same on rows sorted by prompt length first;
- cb: transformers' continuous batching manager (paged cache), per-row max_new_tokens,
  at most batch-size requests per batch;
- score (with --labels a,b,c): no generation; rows sorted by prompt length, each chunk of
  batch-size rows runs every (prompt + label) sequence in one right-padded forward, and the
  label tokens' log-probabilities are summed (lm-evaluation-harness's multiple-choice
  scoring); writes id and scores (the labels' log-probabilities, in label order).
"""

from __future__ import annotations

import argparse
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from bench_workloads import write_baseline_output


def load(model_dir: str, dtype: str = "float32", device: str = "cpu"):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    )
    model.to(device).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model, tok


def chunked(
    model, prompts: list[list[int]], news: list[int], order: list[int], batch: int, pad: int
) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for s in range(0, len(order), batch):
        rows = order[s : s + batch]
        width = max(len(prompts[i]) for i in rows)
        dev = model.device
        ids = torch.tensor(
            [[pad] * (width - len(prompts[i])) + prompts[i] for i in rows], device=dev
        )
        mask = torch.tensor(
            [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=dev
        )
        m = max(news[i] for i in rows)
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=m,
                do_sample=False,
                pad_token_id=pad,
            )[:, width:]
        for i, g in zip(rows, gen.tolist(), strict=True):
            out[i] = g[: news[i]]
    return out


def continuous(
    model, prompts: list[list[int]], news: list[int], batch: int
) -> dict[int, list[int]]:
    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(news))
    cb = transformers.ContinuousBatchingConfig(max_requests_per_batch=batch)
    out: dict[int, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=gc, continuous_batching_config=cb, block=True, timeout=5
    ) as m:
        for i, (p, n) in enumerate(zip(prompts, news, strict=True)):
            m.add_request(p, request_id=str(i), max_new_tokens=n, eos_token_id=-1)
        while len(out) < len(prompts):
            r = m.get_result(timeout=1)
            if r is not None and r.is_finished():
                if r.error:
                    raise RuntimeError(f"request {r.request_id}: {r.error}")
                out[int(r.request_id)] = list(r.generated_tokens)
    return out


def score(
    model, prompts: list[list[int]], labels: list[list[int]], batch: int, pad: int
) -> dict[int, list[float]]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, list[float]] = {}
    with torch.no_grad():
        for s in range(0, len(order), batch):
            rows = order[s : s + batch]
            seqs = [prompts[i] + lab for i in rows for lab in labels]
            width = max(map(len, seqs))
            ids = torch.tensor([q + [pad] * (width - len(q)) for q in seqs], device=model.device)
            mask = torch.tensor(
                [[1] * len(q) + [0] * (width - len(q)) for q in seqs], device=model.device
            )
            lp = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
            for j, i in enumerate(rows):
                n = len(prompts[i])
                out[i] = [
                    sum(lp[j * len(labels) + k, n - 1 + t, x].item() for t, x in enumerate(lab))
                    for k, lab in enumerate(labels)
                ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--mode", choices=("input", "sorted", "cb", "score"), default="sorted")
    p.add_argument("--labels", help="score mode: comma-separated labels")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model, tok = load(a.model_dir, a.dtype, a.device)
    table = pq.read_table(a.input)
    texts = table.column("prompt").to_pylist()
    news = table.column("max_new_tokens").to_pylist()
    prompts = [tok(t)["input_ids"] for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    if a.mode == "score":
        labels = [tok(x, add_special_tokens=False)["input_ids"] for x in a.labels.split(",")]
        scores = score(model, prompts, labels, a.batch_size, pad)
        ids = table.column("id")
        pq.write_table(
            pa.table({"id": ids, "scores": [scores[i] for i in range(len(prompts))]}), a.output
        )
        print(
            f"score batch {a.batch_size}: {len(prompts)} rows in {time.perf_counter() - t0:.1f} s"
        )
        return
    if a.mode == "cb":
        out = continuous(model, prompts, news, a.batch_size)
    else:
        order = list(range(len(prompts)))
        if a.mode == "sorted":
            order.sort(key=lambda i: len(prompts[i]))
        out = chunked(model, prompts, news, order, a.batch_size, pad)
    ids = [out[i] for i in range(len(prompts))]
    write_baseline_output(a.output, table.column("id"), ids, tok)
    print(f"{a.mode} batch {a.batch_size}: {len(ids)} rows in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
