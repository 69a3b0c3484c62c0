"""Run statistics, built from values: what ran (`RunInfo`, once the model is loaded), the sum
of the engine's step reports (`add_step`: counts, the rows' latencies (latency.py), model
FLOPs and bytes (roofline.py), the step timeline (steps.py)), the records written
(`add_records`: rows, error rows), and what the run ended with (`finish`: the KV
pool, peak memory, the GPU's samples). Derived rates are properties; `to_dict` is
_stats.json, `table` the printed summary."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from batchgen.data.verdict import ErrorVerdict, error_reason, reason_lines
from batchgen.engine.sequence import KVPool, StepReport
from batchgen.stats.latency import Latencies, LogHistogram
from batchgen.stats.nvml import gpu_rows
from batchgen.stats.peaks import Peaks, utilisation_text
from batchgen.stats.roofline import ModelCost, Roofline
from batchgen.stats.startup import process_age_s
from batchgen.stats.steps import StepRecorder


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What ran, known once the model is loaded."""

    model: str
    family: str  # config.json's model_type
    device: str
    dtype: str
    compiled: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    prefix_caching: bool
    quantization: dict[str, Any]
    lora: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    weights_bytes_per_rank: int = 0  # parameters a rank holds, at their stored precision
    model_impl: str = "native"  # what ran it: batchgen's decoder, or transformers' modeling code

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.lora is None:
            del d["lora"]
        return d


@dataclass(slots=True)
class RunStats:
    rows_skipped_done: int = 0  # already in the output from an earlier run
    openai_unsupported_fields: dict[str, int] | None = None  # body fields ignored, by lines
    # {max_new_tokens: {value, from}, ...}: option, generation_config.json or batchgen
    generation_defaults: dict[str, Any] | None = None
    info: RunInfo | None = None  # None: the run ended before loading the model
    rows: int = 0  # records written in this run (ok + error; --n-as-list: one a row)
    rows_error: int = 0
    error_reasons: dict[str, int] = field(default_factory=dict)  # error records, by reason
    prompt_tokens: int = 0  # real prompt tokens of the rows run
    computed_prompt_tokens: int = 0  # prompt tokens run through the model (recomputes included)
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    cache_lookups: int = 0  # full prompt blocks looked up in the prefix cache
    cache_hits: int = 0  # of which found
    output_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0  # steps with no prompt tokens
    decode_rows: int = 0  # sequence-steps that decoded a token
    padded_rows: int = 0  # tokens computed only to fill a compiled shape (CUDA graphs)
    compiled_tokens: int = 0  # prompt and decode tokens run through the compiled graph
    preemptions: int = 0
    compiled_shapes: int = 0
    load_s: float = 0.0
    prefill_s: float = 0.0  # steps with prompt tokens (decodes riding along included)
    decode_s: float = 0.0
    compile_s: float = 0.0  # the warm-up's compile (and any compile after it)
    capture_s: float = 0.0  # the warm-up's runs of each capture size (CUDA graphs)
    warmup_s: float = 0.0  # the warm-up's full-size eager steps, before any row
    compile_cache: str | None = None  # "hit": the warm-up compiled no graph, it loaded them
    graphs_compiled: int = 0  # graphs inductor compiled at warm-up (torch's counters)
    collective_s: float = 0.0  # in tensor-parallel collectives, where timed (eager, CPU)
    kv_pool: KVPool | None = None
    peak_memory_bytes: int = 0
    gpu: dict[str, Any] | None = None  # NVML's samples (nvml.GpuSamples.summary)
    complete: bool = False
    started: float = field(default_factory=time.perf_counter)
    started_unix: float = field(default_factory=time.time)  # to line shards up in a merge
    latencies: Latencies = field(default_factory=Latencies)
    host_gaps: LogHistogram = field(default_factory=LogHistogram)  # between steps (host_gap_s)
    roofline: Roofline | None = None  # once the model is loaded
    peaks: Peaks | None = None
    timeline: StepRecorder | None = None
    wall_s: float = 0.0  # the job: from its statistics' start (after start-up) to its end
    startup_s: float | None = field(default_factory=process_age_s)  # the process before that
    verdict: ErrorVerdict | None = None  # the complete job's error rate (data/verdict.py)
    threads: dict[str, int] | None = None  # torch's CPU threads: start, fewest, last, changes

    def __post_init__(self) -> None:
        self.timeline = StepRecorder(self.started)

    def loaded(
        self, info: RunInfo, seconds: float, cost: ModelCost | None, peaks: Peaks | None
    ) -> None:
        """The model is loaded (in `seconds`): what runs from here on, what its tokens cost
        and the hardware's peaks."""
        self.info, self.load_s = info, seconds
        self.roofline = Roofline(cost) if cost is not None else None
        self.peaks = peaks

    def add_records(self, records: list[dict[str, Any]]) -> None:
        """Records written in this run: the rows count records (with --n-as-list a row's one
        record, once all its samples are in; else one a sample), as the part files and the
        --max-error-rate verdict do. Error records (failed rows and rows that keep their text
        with one, a constrained row cut short) group by their reason with its numbers as N
        ("prompt of N tokens ...")."""
        self.rows += len(records)
        for rec in records:
            if rec.get("error") is not None:
                self.rows_error += 1
                reason = error_reason(str(rec["error"]))
                self.error_reasons[reason] = self.error_reasons.get(reason, 0) + 1

    @property
    def error_records(self) -> int:
        """Rows written with an error in this run."""
        return sum(self.error_reasons.values())

    def error_lines(self, most: int = 5) -> list[str]:
        """The commonest error reasons with their counts, for the end of a run."""
        return reason_lines(self.error_reasons, ".batchgen/stats.json", most)

    def add_step(self, r: StepReport) -> None:
        """One engine step: what it ran and its finished samples' tokens and latencies (their
        records are counted as written, `add_records`)."""
        self.prompt_tokens += sum(c.prompt_tokens for c in r.finished)
        self.output_tokens += sum(c.completion_tokens for c in r.finished)
        for c in r.finished:
            self.latencies.add(c)
        self.compile_s += r.compile_seconds
        self.capture_s += r.capture_seconds
        self.warmup_s += r.warmup_seconds
        self.compile_cache = r.compile_cache or self.compile_cache
        self.graphs_compiled += r.graphs_compiled
        if not (r.prompt_tokens or r.decode_rows):  # rows rejected before running, or warm-up
            return
        self.timeline.add(r)
        if self.roofline is not None:
            self.roofline.add(r)
        self.steps += 1
        self.decode_steps += not r.prefill
        self.computed_prompt_tokens += r.prompt_tokens
        self.cached_prompt_tokens += r.cached_tokens
        self.cache_lookups += r.cache_lookups
        self.cache_hits += r.cache_hits
        self.decode_rows += r.decode_rows
        self.padded_rows += r.padded_rows
        self.compiled_tokens += (r.prompt_tokens + r.decode_rows) * r.compiled
        self.preemptions += r.preempted
        self.compiled_shapes += r.new_shape
        self.collective_s += r.collective_seconds
        if r.host_gap_seconds is not None:
            self.host_gaps.add(r.host_gap_seconds)
        if r.prefill:
            self.prefill_s += r.seconds
        else:
            self.decode_s += r.seconds

    def finish(
        self,
        complete: bool,
        peak_memory: int = 0,
        kv_pool: KVPool | None = None,
        gpu: dict[str, Any] | None = None,
    ) -> None:
        """The run ended (complete: every row of the job is in the output)."""
        self.complete, self.peak_memory_bytes = complete, peak_memory
        self.kv_pool, self.gpu = kv_pool, gpu
        self.wall_s = time.perf_counter() - self.started

    @property
    def elapsed(self) -> float:
        return self.wall_s or time.perf_counter() - self.started

    @property
    def prompt_compute_ratio(self) -> float:
        """Prompt tokens computed / real: below 1 with prefix-cache hits, above with padding
        or recomputes after preemption."""
        return self.computed_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_live_share(self) -> float:
        """Decode rows that were live sequences, not shape padding."""
        total = self.decode_rows + self.padded_rows
        return self.decode_rows / total if total else 1.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Full prompt blocks found in the prefix cache / looked up."""
        return self.cache_hits / self.cache_lookups if self.cache_lookups else 0.0

    def rate(self, n: float) -> float:
        return n / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """_stats.json: the counts, the derived rates, what ran and what it ended with."""
        skip = ("started", "info", "kv_pool", "gpu", "openai_unsupported_fields")
        skip += ("latencies", "roofline", "peaks", "timeline", "verdict", "host_gaps")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        d.update(self.latencies.summary())  # ttft_s, tpot_s, latency_s: {p50, ..., max}
        d["latency_histograms"] = self.latencies.to_dict()
        peaks = self.peaks or Peaks(None, None, "unknown")
        d.update(peaks.to_dict())
        if self.roofline is not None:
            d.update(self.roofline.summary(peaks.flops, peaks.bandwidth))
        d.update({k: d.get(k) for k in ("mfu", "mbu")})  # None where no peak is known
        computed = self.computed_prompt_tokens
        d.update(
            rows_per_s=self.rate(self.rows),
            prompt_tokens_per_s=self.rate(self.prompt_tokens),
            output_tokens_per_s=self.rate(self.output_tokens),
            decode_tokens_per_s=self.output_tokens / self.decode_s if self.decode_s else 0.0,
            prompt_compute_ratio=self.prompt_compute_ratio,
            decode_live_share=self.decode_live_share,
            compiled_token_share=self.compiled_tokens / max(1, self.decode_rows + computed),
        )
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        # the host's time between device steps, which a GPU spends idle: p50 and total
        gaps = self.host_gaps
        d["host_gap_s"] = (
            {"p50": gaps.quantile(0.5), "p90": gaps.quantile(0.9), "total": gaps.total}
            if gaps.n
            else None
        )
        # the whole command as the user waits for it, and the engine's own share of the job
        d["total_wall_s"] = self.elapsed + (self.startup_s or 0.0)
        d["engine_s"] = self.prefill_s + self.decode_s
        if self.info is not None:
            d.update(self.info.to_dict())
            if self.info.tensor_parallel_size > 1:
                # the share of step time in collectives; None where they run inside graphs
                # or on the GPU's streams, untimed (docs/architecture.md)
                step_s = self.prefill_s + self.decode_s
                timed = self.collective_s > 0 and step_s > 0
                d["collective_share"] = self.collective_s / step_s if timed else None
        if self.kv_pool is not None:
            d.update(kv_cache_tokens=self.kv_pool.tokens, kv_cache_bytes=self.kv_pool.bytes)
        if self.openai_unsupported_fields:
            d["openai_unsupported_fields"] = self.openai_unsupported_fields
        d.update(self.gpu or {})
        return d

    def _compile_line(self, share: float) -> str:
        warm = f", warm-up {self.warmup_s:.2f} s"
        if self.info is not None and not self.info.compiled:
            return f"eager (no compile){warm}"
        cache = f", compile cache {self.compile_cache}" if self.compile_cache else ""
        graphs = f", {self.graphs_compiled} graphs compiled, {share:.1%} of tokens compiled"
        return f"{self.compile_s:.2f} s / {self.capture_s:.2f} s{cache}{graphs}{warm}"

    def table(self) -> str:
        d = self.to_dict()
        done = f"{self.rows} ({self.rows_error} errors, {self.rows_skipped_done} done before)"
        cached = f"{self.cached_prompt_tokens} from the prefix cache"
        rows = [
            ("rows", done),
            ("wall time", f"{self.elapsed:.2f} s job + {self.startup_s or 0:.2f} s start-up"),
            ("engine steps", f"{d['engine_s']:.2f} s"),
            ("rows/s", f"{d['rows_per_s']:.2f}"),
            ("prompt tokens/s", f"{d['prompt_tokens_per_s']:.1f}"),
            ("output tokens/s", f"{d['output_tokens_per_s']:.1f}"),
            ("prefill / decode", f"{self.prefill_s:.2f} s / {self.decode_s:.2f} s"),
            ("compile / capture", self._compile_line(d["compiled_token_share"])),
            ("model load", f"{self.load_s:.2f} s"),
            ("prompt tokens computed", f"{self.prompt_compute_ratio:.1%} of real ({cached})"),
            ("decode rows live", f"{self.decode_live_share:.1%} ({self.preemptions} preemptions)"),
            ("peak memory", f"{self.peak_memory_bytes / 2**20:.0f} MiB"),
        ]
        for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("latency_s", "latency")):
            if d[key]["p50"] is not None:
                p = d[key]
                ms = " / ".join(f"{p[q] * 1e3:.1f}" for q in ("p50", "p90", "p99"))
                rows.append((f"{name} p50/p90/p99", f"{ms} ms"))
        if d["mfu"] is not None or d["mbu"] is not None:
            rows.append(("MFU / MBU", utilisation_text(d)))
        rows += gpu_rows(d)
        width = max(len(k) for k, _ in rows)
        table = "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
        if self.error_reasons:
            table += f"\nerror rows ({self.error_records}), by reason:\n"
            table += "\n".join(self.error_lines())
        return table
