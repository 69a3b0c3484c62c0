"""The one place where Python lists become tensors: runs planned batches on the model.

A batch is left-padded to its bucket length and prefilled in one call; then a decode
loop feeds one token per row per step. Prefill and decode are separate compiled
callables kept on the runner (decode with CUDA graphs on GPU). The decode graph also
does the stop bookkeeping (EOS, per-row max_new_tokens), so the host loop only records
each step's tokens; it looks at them every `sync_every` steps, to end the batch early
and check stop strings, and not at all when no row can stop early.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from batchgen.engine.sampler import SamplingTensors, sample
from batchgen.engine.sequence import FinishReason, Request
from batchgen.model.transformer import Transformer
from batchgen.planner import BatchPlan, next_pow2

# (row, generated tokens so far) -> number of tokens to keep if a stop string matched
StopFn = Callable[[int, list[int]], int | None]


@dataclass(slots=True)
class RowOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass(slots=True)
class RowTensors:
    """Per-row constants of one batch, on the device, each (B,)."""

    kv_start: torch.Tensor  # first cache slot of the row's prompt (left padding before it)
    sampling: SamplingTensors
    max_new: torch.Tensor
    ignore_eos: torch.Tensor


class DecodeState(NamedTuple):
    """What one decode step hands the next, on the device, each (B,)."""

    tok: torch.Tensor  # the last sampled token
    slot: torch.Tensor  # the cache slot of the token before it
    n_gen: torch.Tensor  # tokens produced so far, EOS included
    done: torch.Tensor  # finished: EOS, max_new_tokens or a stop string


@dataclass(slots=True)
class RunnerStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0  # first calls of each new shape (compile + first run)
    decode_steps: int = 0
    prefix_tokens_saved: int = 0  # prompt tokens a shared prefix spared the prefill
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
            self._prefill = torch.compile(self._prefill_step, fullgraph=True, dynamic=False)
            self._decode = torch.compile(
                self._decode_step,
                fullgraph=True,
                dynamic=False,
                mode="reduce-overhead" if cuda else None,  # CUDA graphs
            )
        else:
            self._prefill, self._decode = self._prefill_step, self._decode_step

    def _prefill_step(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        slots: torch.Tensor,
        rows: RowTensors,
        row_stride: int,
        greedy_only: bool,
        cache_rows: torch.Tensor | None,
        prefix_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill left-padded prompts (B, L) into cache rows cache_rows (B,) (None: rows
        0..B-1), after prefix_len slots of a shared prefix already in the rows; sample
        each row's first token."""
        kv_len = tokens.shape[1] + prefix_len
        logits = self.model(tokens, input_pos, slots, rows.kv_start, kv_len, row_stride, cache_rows)
        steps = torch.zeros_like(rows.kv_start)
        tok = sample(logits, rows.sampling, steps, greedy_only)
        return tok, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]

    def _decode_step(
        self,
        state: DecodeState,
        rows: RowTensors,
        row_stride: int,
        greedy_only: bool,
        kv_len: int,
    ) -> tuple[DecodeState, torch.Tensor, torch.Tensor]:
        """One token for every row, with the stop bookkeeping, as one graph: feed each
        row's last token at its next slot, sample, and update n_gen/done on the device.
        Returns the new state and the step's (B,) tokens (pad for finished rows) and logprobs."""
        # (B,): where the previous token goes. Finished rows keep stepping (their tokens are
        # dropped); an idle slot of a continuous batch can step indefinitely, so it stays on
        # its row's last slot. A short-prompt row can finish early while a long-prompt row
        # goes on, so clamp positions too.
        slot = (state.slot + 1).clamp(max=row_stride - 1)
        pos = (slot - rows.kv_start).clamp(max=self.max_positions - 1)
        logits = self.model(
            state.tok[:, None], pos[:, None], slot[:, None], rows.kv_start, kv_len, row_stride
        )
        # A row's noise depends on how many tokens it has made, not on the batch's step.
        tok = sample(logits, rows.sampling, state.n_gen, greedy_only)
        logprob = logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
        alive = ~state.done
        n_gen = state.n_gen + alive.long()
        done = state.done | self._stops(tok, rows) | (n_gen >= rows.max_new)
        out_tok = torch.where(alive, tok, self.pad_id)
        return DecodeState(tok, slot, n_gen, done), out_tok, logprob

    def _stops(self, tok: torch.Tensor, rows: RowTensors) -> torch.Tensor:
        return (tok[:, None] == self.eos[None, :]).any(-1) & ~rows.ignore_eos

    def _call(self, fn, key: tuple | None, *args) -> tuple:
        """Call fn; return its outputs and, for the first call of a compiled shape (key),
        the time it took (compile + first run), else 0. key None: fn is not compiled."""
        if key is None or key in self.stats.shapes:
            return (*fn(*args), 0.0)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(self.device)
        self.stats.shapes.add(key)
        dt = time.perf_counter() - t0
        self.stats.compile_s += dt
        return (*out, dt)

    def _row_tensors(self, requests: list[Request], b: int, L: int) -> RowTensors:
        """Per-row constants of a batch padded to b rows; padding rows are greedy, one token."""
        dev, pad = self.device, b - len(requests)
        params = [r.params for r in requests]

        def col(values: list, fill, dtype=None) -> torch.Tensor:
            return torch.tensor(values + [fill] * pad, dtype=dtype, device=dev)

        return RowTensors(
            kv_start=col([L - r.prompt_len for r in requests], L - 1),
            sampling=SamplingTensors(
                temperature=col([p.temperature for p in params], 0.0, torch.float32),
                top_k=col([p.top_k for p in params], 0),
                top_p=col([p.top_p for p in params], 1.0, torch.float32),
                seed=col([p.seed for p in params], 0),
            ),
            max_new=col([p.max_new_tokens for p in params], 1),
            ignore_eos=col([p.ignore_eos for p in params], True),
        )

    def prefill(
        self,
        requests: list[Request],
        b: int,
        L: int,
        row_stride: int,
        greedy_only: bool,
        cache_rows: torch.Tensor | None = None,
        prefix_len: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, RowTensors]:
        """Prefill `requests` left-padded to L, as a batch padded to b rows, into cache rows
        cache_rows (B,) (None: 0..b-1). Returns each row's first token and its logprob,
        (b,) each, and the batch's row constants.

        prefix_len > 0: each row's cache already holds a shared prefix of that many tokens at
        slots [kv_start, kv_start + prefix_len), copied there (kv_start = L - len(prompt));
        the requests are the suffixes, which go right after it at positions prefix_len...
        Padding tokens go to the slots before kv_start, which the mask hides."""
        dev = self.device
        tokens = torch.full((b, L), self.pad_id, dtype=torch.long)
        for i, r in enumerate(requests):
            tokens[i, L - r.prompt_len :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        tokens = tokens.to(dev)
        rows = self._row_tensors(requests, b, L)
        slots = torch.arange(L, device=dev).expand(b, L)
        real = slots >= rows.kv_start[:, None]
        slots = torch.where(real, slots + prefix_len, slots)  # (b, L)
        input_pos = (slots - rows.kv_start[:, None]).clamp(min=0)
        key = ("prefill", b, L, greedy_only) if cache_rows is None else ("prefill_rows", b, L, prefix_len, greedy_only)  # fmt: skip

        t0 = time.perf_counter()
        tok, lp, compile_s = self._call(
            self._prefill, key if self.compiled else None,
            tokens, input_pos, slots, rows, row_stride, greedy_only, cache_rows, prefix_len,
        )  # fmt: skip
        _sync(dev)
        self.stats.prefill_s += time.perf_counter() - t0 - compile_s
        return tok, lp, rows

    def decode(
        self,
        state: DecodeState,
        rows: RowTensors,
        row_stride: int,
        greedy_only: bool,
        kv_len: int | None = None,
    ):
        """One compiled decode step attending over the first kv_len slots of each row
        (default: the whole row); returns (state, tokens, logprobs, compile seconds)."""
        kv_len = kv_len or row_stride
        b = state.tok.shape[0]
        cuda_graphs = self.device.type == "cuda" and self.compiled
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        state, tok, lp, dt = self._call(
            self._decode,
            ("decode", b, row_stride, kv_len, greedy_only) if self.compiled else None,
            state,
            rows,
            row_stride,
            greedy_only,
            kv_len,
        )
        if cuda_graphs:  # the graph's outputs are overwritten by its next replay
            state = DecodeState(*(t.clone() for t in state))
            tok, lp = tok.clone(), lp.clone()
        self.stats.decode_steps += 1
        return state, tok, lp, dt

    def run_batch(
        self, requests: list[Request], plan: BatchPlan, stop_fn: StopFn | None = None
    ) -> list[RowOutput]:
        """Generate for `requests` (the plan's real rows, in order) padded to the plan's shape."""
        dev = self.device
        b, L, stride = plan.batch_size, plan.prompt_len, plan.row_stride
        greedy_only = all(r.params.greedy for r in requests)
        tok, lp, rows = self.prefill(requests, b, L, stride, greedy_only)

        n_steps = max(r.params.max_new_tokens for r in requests)
        out = torch.full((b, n_steps), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((b, n_steps), device=dev)
        out[:, 0], out_lp[:, 0] = tok, lp
        n_gen = torch.ones(b, dtype=torch.long, device=dev)  # tokens produced, EOS included
        state = DecodeState(
            tok,
            torch.full((b,), L - 1, device=dev),
            n_gen,
            self._stops(tok, rows) | (n_gen >= rows.max_new),
        )
        cut: dict[int, int] = {}  # row -> tokens kept after a stop string
        # With EOS ignored and no stop strings, only max_new_tokens ends a row: the host
        # need not look before the end.
        early = stop_fn is not None or not all(r.params.ignore_eos for r in requests)

        t0, compile_s = time.perf_counter(), 0.0
        for s in range(1, n_steps):
            host_looks = early and s % self.sync_every == 0
            if host_looks and self._check_host(out, state, s, requests, stop_fn, cut):
                break
            # Every row's query sits at slot L - 1 + s, so it needs slots [0, L + s): attend
            # over that, rounded up to a power-of-two step bucket (a bounded set of shapes),
            # not the whole row: early steps then read far less of the KV cache.
            kv_len = min(stride, L + max(16, next_pow2(s + 1)))
            state, tok, lp, dt = self.decode(state, rows, stride, greedy_only, kv_len)
            compile_s += dt
            out[:, s], out_lp[:, s] = tok, lp
        self._check_host(out, state, n_steps, requests, stop_fn, cut)
        _sync(dev)
        self.stats.decode_s += time.perf_counter() - t0 - compile_s
        return self._collect(out, out_lp, state.n_gen, requests, cut)

    def _check_host(self, out, state: DecodeState, s, requests, stop_fn, cut) -> bool:
        """One device->host sync: apply stop strings; True when every row is done."""
        done = state.done
        if stop_fn is not None:
            host_out, host_n = out[:, :s].tolist(), state.n_gen.tolist()
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
