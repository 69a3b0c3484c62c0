"""batchgen against transformers' batched `generate`, and both against the roofline.

    python scripts/bench.py                                  # CPU defaults (make bench)
    python scripts/bench.py --model llama-8b --n-prompts 1 --prompt-len 128 \\
        --out-len 256 --max-batch 1 --hf-batch-size 1 --engines batchgen,hf   # batch-1 decode

One run measures, on the same model, the same prompts and the same per-row output
lengths (EOS ignored, so every engine does the same work):

- batchgen: `LLM(...).engine.generate`, run twice in one process: the cold run compiles
  every shape, the warm run is the steady state an offline job spends its time in;
- transformers `generate` the way `pipeline(..., batch_size=N)` batches: prompts in input
  order, chunks of N rows left-padded to the chunk's longest prompt, one call per chunk
  with min_new_tokens = max_new_tokens = the chunk's longest output (generate has one
  length per call); only each row's own n tokens count as output. With the default
  dynamic cache ("hf") and with cache_implementation="static" ("hf-static"), after a
  warm-up call per chunk batch size (which is where transformers compiles on CUDA).

Each engine runs in its own process (peak memory is then its own), after a worker that
measures the machine's ceilings (large copy, large matmul) for the roofline. Prints a
markdown report and writes JSON to --out, rewritten after every engine so a timeout
still leaves the finished ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_models  # noqa: E402

ENGINES = ("batchgen", "hf", "hf-static")
SCHEDULES = ("static", "continuous", "continuous-prefix")  # the last: with --prefix-reuse
ENGINE_LABELS = {
    "batchgen": "batchgen",
    "batchgen-continuous": "batchgen, continuous schedule",
    "batchgen-continuous-prefix": "batchgen, continuous schedule + prefix reuse",
    "hf": "transformers generate, dynamic cache",
    "hf-static": "transformers generate, static cache",
}


# --------------------------------------------------------------------------- workload


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    new_tokens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def output_tokens(self) -> int:
        return sum(self.new_tokens)

    def summary(self) -> dict:
        def stats(xs: list[int]) -> dict:
            s = sorted(xs)
            return dict(
                min=s[0], median=s[len(s) // 2], mean=sum(s) / len(s), max=s[-1], total=sum(s)
            )

        return dict(
            n=len(self.prompts), prompt=stats(self.prompt_lens), output=stats(self.new_tokens)
        )


def parse_lengths(spec: str) -> tuple[int, int, int]:
    """ "N" -> fixed N; "MIN:MAX:MEDIAN" -> log-normal with that median, clipped."""
    parts = [int(x) for x in spec.split(":")]
    if len(parts) == 1:
        return parts[0], parts[0], parts[0]
    if len(parts) != 3 or not parts[0] <= parts[2] <= parts[1] or parts[0] < 1:
        raise argparse.ArgumentTypeError(f"length spec {spec!r}: use N or MIN:MAX:MEDIAN")
    return parts[0], parts[1], parts[2]


def draw_lengths(rng: random.Random, n: int, spec: tuple[int, int, int], sigma: float) -> list[int]:
    lo, hi, median = spec
    if lo == hi:
        return [lo] * n
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def make_workload(n: int, prompt_spec, out_spec, prompt_sigma: float, out_sigma: float,
                  vocab: int, seed: int, shared_prefix: int = 0) -> Workload:  # fmt: skip
    """shared_prefix > 0: a labeling job: every prompt starts with the same instruction of
    that many tokens, followed by its own (length-drawn) text."""
    rng = random.Random(seed)
    plens = draw_lengths(rng, n, prompt_spec, prompt_sigma)
    news = draw_lengths(rng, n, out_spec, out_sigma)
    lo = bench_models.EOS + 1  # no special ids inside prompts
    prefix = [rng.randrange(lo, vocab) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(lo, vocab) for _ in range(p)] for p in plens]
    return Workload(prompts, news)


# --------------------------------------------------------------------------- workers


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _memory(device) -> dict:
    import torch

    if device.type == "cuda":
        return dict(
            peak_mem_bytes=torch.cuda.max_memory_allocated(device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
            mem_kind="cuda max_memory_allocated",
        )
    return dict(
        peak_mem_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        mem_kind="process peak RSS",
    )


def _setup(job: dict):
    import torch

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return torch, device, getattr(torch, job["dtype"])


def worker_roofline(job: dict) -> dict:
    import roofline

    torch, device, dtype = _setup(job)
    c = roofline.measure(device, dtype, job.get("copy_bytes"), job.get("matmul_n"))
    return c.to_dict()


def worker_batchgen(job: dict) -> dict:
    torch, device, _ = _setup(job)
    import torch._dynamo.utils as dynamo_utils

    from batchgen.engine.sequence import Request, SamplingParams
    from batchgen.llm import LLM
    from batchgen.planner import BucketConfig

    t0 = time.perf_counter()
    schedule = job.get("schedule", "static")
    llm = LLM(job["model_dir"], dtype=job["dtype"], device=job["device"],
              compile=job["compile"], buckets=BucketConfig(**job["buckets"]),
              schedule=schedule.removesuffix("-prefix"),
              prefix_reuse=schedule.endswith("-prefix"))  # fmt: skip
    _sync(device)
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_bytes()
    requests = [
        Request(i, p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(job["prompts"], job["new_tokens"], strict=True))
    ]
    stats = llm.runner.stats
    runs = []
    for label in ("cold", "warm")[: job["runs"]]:
        before = (stats.prefill_s, stats.decode_s, stats.compile_s, stats.decode_steps)
        shapes_before = len(stats.shapes)
        graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
        results: list = [None] * len(requests)
        computed_prompt = 0
        _sync(device)
        t0 = time.perf_counter()
        first = None
        for batch, completions in llm.engine.generate(requests):
            first = first if first is not None else time.perf_counter() - t0
            computed_prompt += batch.computed_prompt_tokens
            for c in completions:
                results[c.index] = c
        _sync(device)
        wall = time.perf_counter() - t0
        d = [a - b for a, b in zip(
            (stats.prefill_s, stats.decode_s, stats.compile_s, stats.decode_steps), before,
            strict=True)]  # fmt: skip
        runs.append(dict(
            run=label, wall_s=wall, ttfr_s=first, prefill_s=d[0], decode_s=d[1], compile_s=d[2],
            decode_steps=d[3], new_shapes=len(stats.shapes) - shapes_before,
            new_graphs=dynamo_utils.counters["stats"]["unique_graphs"] - graphs_before,
            computed_prompt_tokens=computed_prompt,
        ))  # fmt: skip
    slots = None
    if schedule != "static":  # every decode step computes all slots
        from batchgen.engine.scheduler import ContinuousScheduler

        sched = ContinuousScheduler(requests, llm.buckets, schedule.endswith("-prefix"))
        slots = sched.shape.slots
    return dict(
        load_s=load_s,
        rss_after_load_bytes=rss_loaded,
        runs=runs,
        out_lens=[len(c.token_ids) for c in results],
        head_tokens=[c.token_ids[:8] for c in results],
        compiled=job["compile"],
        schedule=schedule,
        slots=slots,
        prefix_tokens_saved=stats.prefix_tokens_saved // max(1, job["runs"]),
        **_memory(device),
    )


def _hf_chunks(n: int, batch: int) -> list[list[int]]:
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


def worker_hf(job: dict) -> dict:
    torch, device, dtype = _setup(job)
    import transformers

    static = job["engine"] == "hf-static"
    t0 = time.perf_counter()
    kw = dict(device_map=str(device)) if device.type == "cuda" else {}  # straight to the GPU
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype, **kw)
    model = model.to(device).eval()
    tok = transformers.AutoTokenizer.from_pretrained(job["model_dir"])
    _sync(device)
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_bytes()
    pad = bench_models.EOS
    prompts, news = job["prompts"], job["new_tokens"]
    chunks = _hf_chunks(len(prompts), job["hf_batch_size"])
    gen_kw: dict = dict(do_sample=False, pad_token_id=pad)
    if static:
        gen_kw["cache_implementation"] = "static"
        # Size the cache once for the worst chunk (what an informed user does so that
        # later calls reuse it instead of reallocating and, on CUDA, recompiling).
        if hasattr(transformers.GenerationConfig(), "max_cache_len"):
            gen_kw["max_cache_len"] = max(
                max(len(prompts[i]) for i in c) + max(news[i] for i in c) for c in chunks
            )
        if job.get("hf_compile") == "off":
            gen_kw["disable_compile"] = True

    def generate(rows: list[list[int]], m: int) -> torch.Tensor:
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=m,
                                 min_new_tokens=m, **gen_kw)  # fmt: skip
        return out[:, width:]

    # Warm-up: one short call per distinct chunk batch size (kernels, allocator and, for
    # the static cache on CUDA, transformers' automatic compile of the decode step).
    t0 = time.perf_counter()
    for b in sorted({len(c) for c in chunks}):
        generate([list(range(2, 10))] * b, 3).tolist()
    warmup_s = time.perf_counter() - t0

    out_lens = [0] * len(prompts)
    head: list = [None] * len(prompts)
    computed_prompt = computed_decode = 0
    _sync(device)
    t0 = time.perf_counter()
    first = None
    for c in chunks:
        m = max(news[i] for i in c)
        gen = generate([prompts[i] for i in c], m).tolist()  # .tolist() waits for the device
        rows = []
        for i, g in zip(c, gen, strict=True):
            if len(g) != m:
                raise RuntimeError(f"transformers produced {len(g)} tokens for row {i}, wanted {m}")
            rows.append(g[: news[i]])  # only the row's own tokens are useful output
            out_lens[i], head[i] = len(rows[-1]), rows[-1][:8]
        tok.batch_decode(rows, skip_special_tokens=True)  # text, as batchgen and pipeline do
        computed_prompt += len(c) * max(len(prompts[i]) for i in c)
        computed_decode += len(c) * m
        first = first if first is not None else time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return dict(
        load_s=load_s,
        rss_after_load_bytes=rss_loaded,
        warmup_s=warmup_s,
        runs=[dict(run="warm", wall_s=wall, ttfr_s=first)],
        out_lens=out_lens,
        head_tokens=head,
        hf_batch_size=job["hf_batch_size"],
        computed_prompt_tokens=computed_prompt,
        computed_decode_rows=computed_decode,
        generate_kwargs={k: v for k, v in gen_kw.items() if k != "pad_token_id"},
        transformers_version=transformers.__version__,
        **_memory(device),
    )


WORKERS = {"roofline": worker_roofline, "batchgen": worker_batchgen,
           "batchgen-continuous": worker_batchgen, "batchgen-continuous-prefix": worker_batchgen,
           "hf": worker_hf, "hf-static": worker_hf}  # fmt: skip


def run_worker(job: dict, in_process: bool, timeout: float | None, log) -> dict:
    """Run one engine; in a fresh Python process unless in_process."""
    if in_process:
        return WORKERS[job["engine"]](job)
    with tempfile.TemporaryDirectory() as tmp:
        job_file, res_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            str(job_file),
            str(res_file),
        ]
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=log, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return dict(error=f"timed out after {timeout:.0f} s")
        if proc.returncode != 0 or not res_file.is_file():
            return dict(error=f"worker exited with {proc.returncode}; see the log above")
        return json.loads(res_file.read_text())


# --------------------------------------------------------------------------- analysis


def engine_report(name: str, res: dict, work: Workload, plan_info: dict) -> list[dict]:
    """One row per measured run, with rates and efficiencies."""
    rows = []
    for run in res.get("runs", []):
        wall = run["wall_s"]
        row = dict(
            engine=name,
            run=run["run"],
            wall_s=wall,
            output_tok_s=work.output_tokens / wall,
            total_tok_s=(work.output_tokens + work.prompt_tokens) / wall,
            ttfr_s=run.get("ttfr_s"),
            peak_mem_bytes=res.get("peak_mem_bytes"),
            load_s=res.get("load_s"),
        )
        if name.startswith("batchgen"):
            row.update(
                compile_s=run["compile_s"],
                prefill_s=run["prefill_s"],
                decode_s=run["decode_s"],
                decode_steps=run["decode_steps"],
                host_other_s=wall - run["prefill_s"] - run["decode_s"] - run["compile_s"],
                new_graphs=run["new_graphs"],
                prompt_padding_eff=plan_info["prompt_padding_eff"],
                decode_row_eff=plan_info["decode_row_eff"],
            )
            if res.get("slots"):  # continuous: from what ran, not from the static plan
                row.update(
                    prompt_padding_eff=work.prompt_tokens / run["computed_prompt_tokens"],
                    # the first token of each row comes from its prefill
                    decode_row_eff=(work.output_tokens - len(work.prompts))
                    / (run["decode_steps"] * res["slots"]),
                )
        else:
            row.update(
                compile_s=res.get("warmup_s"),
                prompt_padding_eff=work.prompt_tokens / res["computed_prompt_tokens"],
                decode_row_eff=work.output_tokens / res["computed_decode_rows"],
            )
        rows.append(row)
    return rows


def plan_info(work: Workload, buckets: dict) -> dict:
    from batchgen.planner import BucketConfig, plan_batches

    plan = plan_batches(work.prompt_lens, work.new_tokens, BucketConfig(**buckets))
    computed_decode = sum(
        b.batch_size * max(work.new_tokens[i] for i in b.indices) for b in plan.batches
    )
    return dict(
        batches=len(plan.batches),
        shapes=len(plan.shapes),
        prompt_padding_eff=plan.padding_efficiency,
        decode_row_eff=work.output_tokens / computed_decode,
        rows_per_batch=[len(b.indices) for b in plan.batches],
        batch_rows=[
            [(work.prompt_lens[i], work.new_tokens[i]) for i in b.indices] for b in plan.batches
        ],
    )


def roofline_report(
    model_dir: Path, dtype: str, ceilings: dict, plan: dict, bg: dict | None
) -> dict:
    import roofline
    import torch

    from batchgen.model.loader import config_from_hf, read_hf_config

    cfg = config_from_hf(read_hf_config(model_dir))
    cost = roofline.ModelCost.from_config(cfg, getattr(torch, dtype).itemsize)
    c = roofline.Ceilings(**ceilings)
    dec = roofline.decode_bound(plan["batch_rows"], cost, c)
    pre = roofline.prefill_bound(plan["batch_rows"], cost, c)
    out = dict(
        model_cost=asdict(cost),
        weight_bytes=cost.weight_bytes,
        decode_bound=dec.to_dict(),
        prefill_bound=pre.to_dict(),
        total_bound_s=dec.seconds + pre.seconds,
    )
    warm = next((r for r in (bg or {}).get("runs", []) if r["run"] == "warm"), None)
    warm = warm or next(iter((bg or {}).get("runs", [])), None)
    if warm:
        steps = warm["decode_steps"]
        out.update(
            decode_achieved_s=warm["decode_s"],
            decode_frac_of_bound=dec.seconds / warm["decode_s"] if warm["decode_s"] else None,
            prefill_achieved_s=warm["prefill_s"],
            prefill_frac_of_bound=pre.seconds / warm["prefill_s"] if warm["prefill_s"] else None,
            decode_ms_per_step=1e3 * warm["decode_s"] / steps if steps else None,
            decode_bound_ms_per_step=1e3 * dec.seconds / dec.steps if dec.steps else None,
            decode_tok_s=dec.tokens / warm["decode_s"] if warm["decode_s"] else None,
            decode_bound_tok_s=dec.tokens / dec.seconds if dec.seconds else None,
        )
    return out


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _f(x, spec=".2f", none="-") -> str:
    return none if x is None else format(x, spec)


def markdown(report: dict) -> str:
    w, m = report["workload"], report["model"]
    lines = [
        f"### {m['shape'] or m['dir']} ({_count(m['params'])} params, {report['dtype']}) on "
        f"{report['device_name']}",
        "",
        f"{report['date']} · `{report['command']}`",
        "",
        f"Workload: {w['n']} prompts, prompt tokens {w['prompt']['min']}..{w['prompt']['max']} "
        f"(median {w['prompt']['median']}, total {w['prompt']['total']}), output tokens "
        f"{w['output']['min']}..{w['output']['max']} (median {w['output']['median']}, total "
        f"{w['output']['total']}), EOS ignored. batchgen plan: {report['plan']['batches']} batches, "
        f"{report['plan']['shapes']} shapes.",
        "",
    ]
    load = max(report["loadavg_start"], report.get("loadavg_end", 0.0))
    if report["device"] == "cpu" and load > 0.5 * report["cpus"]:
        lines += [f"**Noisy: load average {load:.1f} on {report['cpus']} CPUs: other work was "
                  "running; these CPU figures are not a benchmark.**", ""]  # fmt: skip
    h = report.get("headline")
    if h:
        lines += [f"**Headline: batchgen / transformers = {h['ratio']:.2f}x output tokens/s** "
                  f"(batchgen warm vs best transformers variant, {h['vs']}); cold batchgen "
                  f"(compile included) {_f(h.get('cold_ratio'))}x.", ""]  # fmt: skip
    lines += [
        "| engine | run | wall s | out tok/s | total tok/s | vs best HF | first result s | "
        "compile / warm-up s | peak mem | prompt pad eff | decode row eff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    best = h["best_hf_tok_s"] if h else None
    for r in report["rows"]:
        label = ENGINE_LABELS.get(r["engine"], r["engine"])
        if not r["engine"].startswith("batchgen"):
            label += f", batch {r.get('hf_batch_size', '?')}"
        lines.append(
            f"| {label} | {r['run']} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | "
            f"{r['total_tok_s']:.1f} | {_f(r['output_tok_s'] / best if best else None)}x | "
            f"{_f(r['ttfr_s'])} | {_f(r.get('compile_s'))} | {_fmt_bytes(r['peak_mem_bytes'])} | "
            f"{r['prompt_padding_eff']:.0%} | {r['decode_row_eff']:.0%} |"
        )
    for name, err in report.get("errors", {}).items():
        lines.append(f"| {ENGINE_LABELS.get(name, name)} | failed | {err} | | | | | | | | |")
    bg = next((r for r in report["rows"] if r["engine"] == "batchgen" and r["run"] == "warm"), None)
    if bg:
        lines += ["", f"batchgen warm run: prefill {bg['prefill_s']:.2f} s, decode {bg['decode_s']:.2f} s "
                  f"({bg['decode_steps']} steps), host/other {bg['host_other_s']:.2f} s, "
                  f"graphs compiled during it: {bg['new_graphs']}."]  # fmt: skip
    cont = next(
        (r for r in report["rows"] if r["engine"] == "batchgen-continuous" and r["run"] == "warm"),
        None,
    )
    if bg and cont:
        cold = {r["engine"]: r for r in report["rows"] if r["run"] == "cold"}
        lines += ["", f"**Continuous / static schedule (warm): {cont['output_tok_s'] / bg['output_tok_s']:.2f}x "
                  "output tokens/s**"
                  + (f"; cold (compile included): {cold['batchgen-continuous']['output_tok_s'] / cold['batchgen']['output_tok_s']:.2f}x"
                     if {"batchgen", "batchgen-continuous"} <= cold.keys() else "")
                  + f". Continuous warm run: prefill {cont['prefill_s']:.2f} s, decode {cont['decode_s']:.2f} s "
                  f"({cont['decode_steps']} steps), graphs compiled during it: {cont['new_graphs']}."]  # fmt: skip
    pre = next(
        (
            r
            for r in report["rows"]
            if r["engine"] == "batchgen-continuous-prefix" and r["run"] == "warm"
        ),
        None,
    )
    if pre and cont:
        saved = report["results"]["batchgen-continuous-prefix"].get("prefix_tokens_saved")
        lines += ["", f"**Prefix reuse on / off (continuous, warm): {pre['output_tok_s'] / cont['output_tok_s']:.2f}x "
                  f"output tokens/s**; prefill {pre['prefill_s']:.2f} s vs {cont['prefill_s']:.2f} s; "
                  f"prompt tokens not prefilled per run: {saved}."]  # fmt: skip
    c, rl = report.get("ceilings"), report.get("roofline")
    if c and "error" not in c:
        lines += [
            "",
            f"Ceilings measured in this run: copy {c['bandwidth_Bps'] / 1e9:.1f} GB/s (read + write), "
            f"matmul {c['dtype']} n={c['matmul_n']}: {c['matmul_flops'] / 1e9:,.0f} GFLOP/s. Weights read "
            f"per decode step: {_fmt_bytes(rl['weight_bytes'])}.",
        ]
    if rl and rl.get("decode_achieved_s") is not None:
        db, pb = rl["decode_bound"], rl["prefill_bound"]
        lines += [
            "",
            "| phase (batchgen, warm) | bound s | achieved s | achieved / bound | per step: bound ms / achieved ms | tok/s: bound / achieved | memory-bound steps |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| decode | {db['seconds']:.3f} | {rl['decode_achieved_s']:.3f} | "
            f"{_f(rl['decode_frac_of_bound'], '.1%')} | {_f(rl['decode_bound_ms_per_step'])} / "
            f"{_f(rl['decode_ms_per_step'])} | {_f(rl['decode_bound_tok_s'], '.0f')} / "
            f"{_f(rl['decode_tok_s'], '.0f')} | {db['memory_bound_steps']}/{db['steps']} |",
            f"| prefill | {pb['seconds']:.3f} | {rl['prefill_achieved_s']:.3f} | "
            f"{_f(rl['prefill_frac_of_bound'], '.1%')} | | | {pb['memory_bound_steps']}/{pb['steps']} |",
        ]
        if max(rl["decode_frac_of_bound"] or 0, rl["prefill_frac_of_bound"] or 0) > 1:
            lines.append("\n**A phase beat its bound: a ceiling was under-measured (a busy "
                         "machine during the copy or the matmul); read the fractions as rough.**")  # fmt: skip
        lines.append(
            f"\nWhole workload at the roofline (batchgen's batches): {rl['total_bound_s']:.3f} s; "
            + ", ".join(
                f"{ENGINE_LABELS.get(r['engine'], r['engine'])} {r['run']} "
                f"{rl['total_bound_s'] / r['wall_s']:.1%} of it"
                for r in report["rows"]
            )
            + "."
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])  # fmt: skip
    p.add_argument("--model", default="llama-30m,gpt2-124m",
                   help=f"comma-separated shapes ({', '.join(bench_models.SHAPES)}), one report each")  # fmt: skip
    p.add_argument("--model-dir", default=None, help="an existing checkpoint instead of --model")
    p.add_argument("--cache-root", default=None, help="where random checkpoints are kept")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=parse_lengths, default="16:1024:96",
                   help="N, or MIN:MAX:MEDIAN for log-normal lengths")  # fmt: skip
    p.add_argument("--prompt-sigma", type=float, default=1.0)
    p.add_argument("--out-len", type=parse_lengths, default="16:256:48")
    p.add_argument("--out-sigma", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="labeling workload: one instruction of N tokens before every prompt")  # fmt: skip
    p.add_argument(
        "--schedule",
        default="static",
        help="batchgen schedules to run, comma-separated: static, continuous, "
        "continuous-prefix (with prefix reuse); static "
        "is the one compared with transformers)",
    )
    p.add_argument("--hf-batch-size", default="16",
                   help="transformers rows per generate call; comma list to try several")  # fmt: skip
    p.add_argument("--hf-compile", choices=["auto", "off"], default="auto",
                   help="static cache: transformers' automatic compile on CUDA, or off")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=None, help="batchgen (default 64 CPU, 256 GPU)")
    p.add_argument("--min-bucket", type=int, default=16, help="batchgen's smallest prompt bucket")
    p.add_argument("--prefill-budget", type=int, default=16384)
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="batchgen KV cache capacity (default 16384 CPU, 131072 GPU)")  # fmt: skip
    p.add_argument("--no-compile", action="store_true", help="batchgen eager")
    p.add_argument("--runs", type=int, choices=[1, 2], default=2,
                   help="batchgen runs: cold (compiles) + warm, or cold only")  # fmt: skip
    p.add_argument("--copy-mib", type=int, default=None, help="roofline copy size")
    p.add_argument("--matmul-n", type=int, default=None, help="roofline matmul size")
    p.add_argument("--engine-timeout", type=float, default=None, help="seconds per engine")
    p.add_argument("--in-process", action="store_true",
                   help="no worker processes (tests); peak memory is then shared")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON report")
    p.add_argument("--markdown", default=None, help="also write the markdown report here")
    p.add_argument("--worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def bench_one(args, shape: str | None, device: str, dtype: str, command: str, log) -> dict:
    import torch

    cuda = device.startswith("cuda")
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        print(f"[bench] preparing {shape} ({dtype}) ...", file=log, flush=True)
        model_dir = bench_models.cached(shape, dtype, device if cuda else "cpu", args.cache_root)
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    work = make_workload(args.n_prompts, args.prompt_len, args.out_len, args.prompt_sigma,
                         args.out_sigma, hf_cfg["vocab_size"], args.seed,
                         args.shared_prefix)  # fmt: skip
    from batchgen.model.loader import config_from_hf

    mcfg = config_from_hf(hf_cfg)
    # the workload's cap, as a job's --max-prompt-len would be
    max_prompt = args.prompt_len[1] + args.shared_prefix
    buckets = dict(
        max_prompt_len=max_prompt,
        min_bucket=min(args.min_bucket, max_prompt),
        max_batch=args.max_batch or (256 if cuda else 64),
        prefill_token_budget=args.prefill_budget,
        kv_capacity_tokens=args.kv_tokens or (131072 if cuda else 16384),
    )
    plan = plan_info(work, buckets)
    base = dict(model_dir=str(model_dir), device=device, dtype=dtype, threads=args.threads)
    report = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command,
        host=platform.node(),
        cpus=os.cpu_count(),
        loadavg_start=os.getloadavg()[0],
        device=device,
        device_name=_device_name(device),
        dtype=dtype,
        torch_version=torch.__version__,
        model=dict(
            shape=shape, dir=str(model_dir), params=mcfg.num_params, family=mcfg.family.value
        ),
        workload=work.summary(),
        buckets=buckets,
        plan={k: v for k, v in plan.items() if k != "batch_rows"},
        isolated=not args.in_process,
        results={},
        errors={},
        rows=[],
    )

    def save() -> None:
        all_reports = [*args.done_reports, report]
        if args.out:
            Path(args.out).write_text(json.dumps(all_reports, indent=1, default=str))
        if args.markdown:
            Path(args.markdown).write_text("\n\n".join(markdown(r) for r in all_reports) + "\n")

    jobs = [dict(base, engine="roofline", copy_bytes=(args.copy_mib or 0) << 20 or None,
                 matmul_n=args.matmul_n)]  # fmt: skip
    work_kw = dict(prompts=work.prompts, new_tokens=work.new_tokens)
    for engine in args.engines.split(","):
        if engine == "batchgen":
            for schedule in args.schedule.split(","):
                if schedule not in SCHEDULES:
                    raise SystemExit(
                        f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}"
                    )
                name = engine if schedule == "static" else f"{engine}-{schedule}"
                jobs.append(dict(base, **work_kw, engine=name, buckets=buckets, schedule=schedule,
                                 compile=not args.no_compile, runs=args.runs))  # fmt: skip
        elif engine in ("hf", "hf-static"):
            for bs in args.hf_batch_size.split(","):
                jobs.append(dict(base, **work_kw, engine=engine, hf_batch_size=int(bs),
                                 hf_compile=args.hf_compile))  # fmt: skip
        else:
            raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    for job in jobs:
        key = job["engine"] + (f"@{job['hf_batch_size']}" if "hf_batch_size" in job else "")
        print(f"[bench] {shape or model_dir}: {key} ...", file=log, flush=True)
        t0 = time.perf_counter()
        res = run_worker(job, args.in_process, args.engine_timeout, log)
        print(f"[bench] {key} done in {time.perf_counter() - t0:.1f} s", file=log, flush=True)
        if "error" in res:
            report["errors"][key] = res["error"]
            save()
            continue
        report["results"][key] = res
        if job["engine"] == "roofline":
            report["ceilings"] = res
            continue
        res["tokens_match"] = res["out_lens"] == work.new_tokens
        if not res["tokens_match"]:
            report["errors"][key] = "output lengths differ from the workload's"
        for row in engine_report(job["engine"], res, work, plan):
            row["hf_batch_size"] = job.get("hf_batch_size")
            report["rows"].append(row)
        _derive(report, model_dir, dtype, plan)
        save()
    report["loadavg_end"] = os.getloadavg()[0]
    _derive(report, model_dir, dtype, plan)
    save()
    return report


def _derive(report: dict, model_dir: Path, dtype: str, plan: dict) -> None:
    rows = report["rows"]
    bg = {r["run"]: r for r in rows if r["engine"] == "batchgen"}
    hf = [r for r in rows if not r["engine"].startswith("batchgen")]
    if bg and hf:
        best = max(hf, key=lambda r: r["output_tok_s"])
        warm = bg.get("warm") or bg.get("cold")
        report["headline"] = dict(
            ratio=warm["output_tok_s"] / best["output_tok_s"],
            vs=f"{ENGINE_LABELS[best['engine']]}, batch {best['hf_batch_size']}",
            best_hf_tok_s=best["output_tok_s"],
            cold_ratio=bg["cold"]["output_tok_s"] / best["output_tok_s"] if "cold" in bg else None,
            per_variant={
                f"{r['engine']}@{r['hf_batch_size']}": warm["output_tok_s"] / r["output_tok_s"]
                for r in hf
            },
        )
        # Same function, same inputs: the first generated tokens should mostly agree.
        res = report["results"]
        b_head = res["batchgen"]["head_tokens"]
        for key, r in res.items():
            if key.startswith("hf") and "head_tokens" in r:
                same = sum(a[:1] == b[:1] for a, b in zip(b_head, r["head_tokens"], strict=True))
                r["first_token_agreement"] = same / len(b_head)
    if "ceilings" in report:
        report["roofline"] = roofline_report(
            model_dir, dtype, report["ceilings"], plan, report["results"].get("batchgen")
        )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(WORKERS[job["engine"]](job)))
        return []
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = (
        args.dtype
        if args.dtype != "auto"
        else ("bfloat16" if device.startswith("cuda") else "float32")
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.done_reports = []
    for f in (args.out, args.markdown):
        if f:
            Path(f).parent.mkdir(parents=True, exist_ok=True)
    shapes = [None] if args.model_dir else args.model.split(",")
    for shape in shapes:
        report = bench_one(args, shape, device, dtype, command, sys.stderr)
        args.done_reports.append(report)
        print(markdown(report) + "\n", flush=True)
    return args.done_reports


if __name__ == "__main__":
    main()
