"""The one place where Python lists become tensors: runs planned batches on the model.

A batch is left-padded to its bucket length and prefilled in one call; then a decode
loop feeds one token per row per step. Prefill and decode are separate compiled
callables kept on the runner (decode with CUDA graphs on GPU). Stop bookkeeping (EOS,
per-row max_new_tokens) happens on the device; the host looks only every
`sync_every` steps, to end the batch early and check stop strings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchgen.engine.sampler import SamplingTensors, sample
from batchgen.engine.sequence import FinishReason, Request
from batchgen.model.transformer import Transformer
from batchgen.planner import BatchPlan

# (row, generated tokens so far) -> number of tokens to keep if a stop string matched
StopFn = Callable[[int, list[int]], int | None]


@dataclass(slots=True)
class RowOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass(slots=True)
class RunnerStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0  # first calls of each new shape (compile + first run)
    decode_steps: int = 0
    shapes: set = field(default_factory=set)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        *,
        kv_capacity_tokens: int,
        max_seq: int,
        eos_ids: list[int],
        pad_id: int,
        compile: bool = True,
        sync_every: int = 8,
    ) -> None:
        self.model = model
        self.device = model.embed.weight.device
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=self.device)
        self.pad_id = pad_id
        self.sync_every = sync_every
        self.stats = RunnerStats()
        # Positions the model has a table (learned or RoPE) for: a row may use [0, max_positions).
        self.max_positions = min(max_seq, model.cfg.max_position_embeddings)
        model.setup_caches(kv_capacity_tokens, max_seq)
        self.compiled = compile
        if compile:
            import torch._dynamo.config as dynamo_config

            # Each (batch, bucket) shape is one specialisation; allow the bounded set.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
            cuda = self.device.type == "cuda"
            self._prefill = torch.compile(self._step, fullgraph=True, dynamic=False)
            self._decode = torch.compile(
                self._step, fullgraph=True, dynamic=False, mode="reduce-overhead" if cuda else None
            )
        else:
            self._prefill = self._decode = self._step

    def _step(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        slots: torch.Tensor,
        kv_start: torch.Tensor,
        sampling: SamplingTensors,
        steps: torch.Tensor,
        kv_len: int,
        row_stride: int,
        greedy_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(tokens, input_pos, slots, kv_start, kv_len, row_stride)  # (B, V)
        next_tok = sample(logits, sampling, steps, greedy_only)
        logprob = logits.log_softmax(-1).gather(-1, next_tok[:, None])[:, 0]
        return next_tok, logprob

    def _call(self, fn, key: tuple, *args) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Call fn; return its outputs and, for the first call of a shape, the time it
        took (compile + first run), else 0."""
        if key in self.stats.shapes or not self.compiled:
            return (*fn(*args), 0.0)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(self.device)
        self.stats.shapes.add(key)
        dt = time.perf_counter() - t0
        self.stats.compile_s += dt
        return (*out, dt)

    def run_batch(
        self, requests: list[Request], plan: BatchPlan, stop_fn: StopFn | None = None
    ) -> list[RowOutput]:
        """Generate for `requests` (the plan's real rows, in order) padded to the plan's shape."""
        dev, n = self.device, len(requests)
        b, L, stride = plan.batch_size, plan.prompt_len, plan.row_stride
        lens = [r.prompt_len for r in requests] + [1] * (b - n)
        tokens = torch.full((b, L), self.pad_id, dtype=torch.long)
        for i, r in enumerate(requests):
            tokens[i, L - r.prompt_len :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        params = [r.params for r in requests]
        max_new = [p.max_new_tokens for p in params] + [1] * (b - n)
        greedy_only = all(p.greedy for p in params)
        sampling = SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params] + [0.0] * (b - n), device=dev),
            top_k=torch.tensor([p.top_k for p in params] + [0] * (b - n), device=dev),
            top_p=torch.tensor([p.top_p for p in params] + [1.0] * (b - n), device=dev),
            seed=torch.tensor([p.seed for p in params] + [0] * (b - n), device=dev),
        )
        ignore_eos = torch.tensor([p.ignore_eos for p in params] + [True] * (b - n), device=dev)
        max_new_t = torch.tensor(max_new, device=dev)

        tokens = tokens.to(dev)
        kv_start = torch.tensor([L - n_ for n_ in lens], device=dev)  # (B,)
        slots = torch.arange(L, device=dev).expand(b, L)
        input_pos = (slots - kv_start[:, None]).clamp(min=0)
        steps = torch.zeros(b, dtype=torch.long, device=dev)

        t0 = time.perf_counter()
        tok, lp, compile_s = self._call(
            self._prefill, ("prefill", b, L, greedy_only),
            tokens, input_pos, slots, kv_start, sampling, steps, L, stride, greedy_only,
        )  # fmt: skip
        _sync(dev)
        self.stats.prefill_s += time.perf_counter() - t0 - compile_s

        n_steps = max(max_new)
        out = torch.full((b, n_steps), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((b, n_steps), device=dev)
        out[:, 0], out_lp[:, 0] = tok, lp
        n_gen = torch.ones(b, dtype=torch.long, device=dev)  # tokens produced, EOS included
        done = (torch.isin(tok, self.eos) & ~ignore_eos) | (n_gen >= max_new_t)
        cut: dict[int, int] = {}  # row -> tokens kept after a stop string

        t0, compile_s = time.perf_counter(), 0.0
        slot = torch.full((b, 1), L - 1, dtype=torch.long, device=dev)
        for s in range(1, n_steps):
            if s % self.sync_every == 0 and self._check_host(
                out, n_gen, done, s, requests, stop_fn, cut
            ):
                break
            slot = slot + 1  # (B, 1): the previous token's slot
            if dev.type == "cuda" and self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            # Finished rows keep stepping (their tokens are dropped); a short-prompt row can
            # finish early while a long-prompt row is still going, so clamp their positions.
            pos = (slot - kv_start[:, None]).clamp(max=self.max_positions - 1)
            tok, lp, dt = self._call(
                self._decode, ("decode", b, stride, greedy_only),
                tok[:, None].clone(), pos, slot, kv_start, sampling,
                steps + s, stride, stride, greedy_only,
            )  # fmt: skip
            compile_s += dt
            self.stats.decode_steps += 1
            alive = ~done
            out[:, s] = torch.where(alive, tok, self.pad_id)
            out_lp[:, s] = lp
            n_gen += alive.long()
            done |= (torch.isin(tok, self.eos) & ~ignore_eos) | (n_gen >= max_new_t)
        self._check_host(out, n_gen, done, n_steps, requests, stop_fn, cut)
        _sync(dev)
        self.stats.decode_s += time.perf_counter() - t0 - compile_s
        return self._collect(out, out_lp, n_gen, requests, cut)

    def _check_host(self, out, n_gen, done, s, requests, stop_fn, cut) -> bool:
        """One device->host sync: apply stop strings; True when every row is done."""
        if stop_fn is not None:
            host_out, host_n = out[:, :s].tolist(), n_gen.tolist()
            for i, r in enumerate(requests):
                if i in cut or not r.params.stop:
                    continue
                keep = stop_fn(i, host_out[i][: host_n[i]])
                if keep is not None:
                    cut[i] = keep
                    done[i] = True
        return bool(done.all())

    def _collect(self, out, out_lp, n_gen, requests, cut) -> list[RowOutput]:
        host_out, host_lp, host_n = out.tolist(), out_lp.tolist(), n_gen.tolist()
        eos = set(self.eos.tolist())
        results = []
        for i, r in enumerate(requests):
            n = cut.get(i, host_n[i])
            ids = host_out[i][:n]
            stopped = i in cut or (not r.params.ignore_eos and bool(ids) and ids[-1] in eos)
            reason = FinishReason.STOP if stopped else FinishReason.LENGTH
            results.append(RowOutput(ids, host_lp[i][:n], reason))
        return results
