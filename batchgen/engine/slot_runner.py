"""Continuous batching on the static KV cache: the device side.

A window's rows decode together as `slots` cache rows of one stride, so decode is one
compiled (CUDA-graphed) shape. Each slot's row constants (kv_start, sampling params,
max_new, ignore_eos) and decode state (last token, slot, n_gen, done) live in (slots,)
tensors. A refill prefills new prompts straight into the cache rows of free slots (the
model's `rows` argument) and writes their constants and first token into those tensors;
the other slots are not touched. A round runs a few decode steps, then looks at the host
once: each running row takes the tokens it made in the round (n_gen says how many),
stop strings are checked, and finished rows come back to be reported and refilled.

A slot's previous occupant leaves its keys/values behind; the new row never sees them:
prefill overwrites slots [0, L) and the mask hides slots past a row's current one.

Shared prefix (shape.prefix_len = P > 0): the prefix is prefilled once into its own cache
row at positions 0..P-1. A row's layout is [left padding][prefix][suffix], kv_start at the
end of the padding: a refill copies the prefix's keys/values into each new row right after
its padding, then prefills only the left-padded suffixes, at positions P.. and slots right
after the copy (their padding tokens write to the padding slots), so positions are
contiguous and the mask is the usual one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.model_runner import DecodeState, ModelRunner, RowOutput, RowTensors
from batchgen.engine.sampler import SamplingTensors
from batchgen.engine.scheduler import Refill, SlotShape
from batchgen.engine.sequence import FinishReason, Request

# (request, generated tokens so far) -> number of tokens to keep if a stop string matched
RowStopFn = Callable[[Request, list[int]], int | None]


@dataclass(slots=True)
class RunningRow:
    """Host-side record of a slot's row: what it has produced so far."""

    request: Request
    token_ids: list[int]
    logprobs: list[float]


class SlotRunner:
    def __init__(self, runner: ModelRunner, shape: SlotShape, greedy_only: bool) -> None:
        self.runner, self.shape, self.greedy_only = runner, shape, greedy_only
        dev, b = runner.device, shape.slots

        def col(fill, dtype=torch.long) -> torch.Tensor:
            return torch.full((b,), fill, dtype=dtype, device=dev)

        # Empty slots are finished greedy rows: they step on their row's last slot, unseen.
        self.rows = RowTensors(
            kv_start=col(0),
            sampling=SamplingTensors(
                temperature=col(0.0, torch.float32),
                top_k=col(0),
                top_p=col(1.0, torch.float32),
                seed=col(0),
            ),
            max_new=col(1),
            ignore_eos=col(True, torch.bool),
        )
        self.state = DecodeState(col(runner.pad_id), col(0), col(0), col(True, torch.bool))
        self.running: dict[int, RunningRow] = {}  # slot -> row
        self.scratch_row, self.prefix_row = shape.slots, shape.slots + 1

    def prefill_prefix(self, prefix_ids: list[int]) -> None:
        """Prefill the shared prefix into its own row, at positions and slots 0..P-1."""
        assert len(prefix_ids) == self.shape.prefix_len
        prefix = Request(-1, list(prefix_ids))
        rows = torch.tensor([self.prefix_row], device=self.runner.device)
        self.runner.prefill([prefix], 1, len(prefix_ids), self.shape.row_stride, True, rows)

    def refill(self, refill: Refill, requests: list[Request]) -> None:
        """Prefill `requests` into the cache rows of refill.slots and start them decoding."""
        r, dev, n = self.runner, self.runner.device, len(requests)
        L, P, stride = refill.prompt_len, self.shape.prefix_len, self.shape.row_stride
        if P:
            requests = [Request(q.index, q.prompt_ids[P:], q.params) for q in requests]
            # each new row: the prefix right after its left padding, at [kv_start, kv_start + P)
            kv_start = torch.tensor([L - q.prompt_len for q in requests], device=dev)
            src = self.prefix_row * stride + torch.arange(P, device=dev)  # (P,)
            offsets = kv_start[:, None] + torch.arange(P, device=dev)  # (n, P)
            dst = torch.tensor(refill.slots, device=dev)[:, None] * stride + offsets
            for cache in r.model.kv_caches:
                cache.copy(src, dst)
            r.stats.prefix_tokens_saved += n * P
        # Padding rows of the prefill batch write to the scratch row past the last slot.
        cache_rows = list(refill.slots) + [self.scratch_row] * (refill.batch_size - n)
        tok, lp, rows = r.prefill(
            requests,
            refill.batch_size,
            L,
            stride,
            self.greedy_only,
            torch.tensor(cache_rows, device=dev),
            P,
        )
        idx = torch.tensor(refill.slots, device=dev)
        new, old = rows, self.rows
        pairs = [
            (old.kv_start, new.kv_start),
            (old.max_new, new.max_new),
            (old.ignore_eos, new.ignore_eos),
            (old.sampling.temperature, new.sampling.temperature),
            (old.sampling.top_k, new.sampling.top_k),
            (old.sampling.top_p, new.sampling.top_p),
            (old.sampling.seed, new.sampling.seed),
        ]
        for dst, src in pairs:
            dst[idx] = src[:n]
        done = r._stops(tok, new) | (new.max_new <= 1)  # a row can end at its first token
        tok, lp = tok[:n], lp[:n]
        st = self.state
        st.tok[idx] = tok
        st.slot[idx] = L + P - 1  # the last prompt token's slot
        st.n_gen[idx] = 1
        st.done[idx] = done[:n]
        for slot, req, t, p in zip(refill.slots, requests, tok.tolist(), lp.tolist(), strict=True):
            self.running[slot] = RunningRow(req, [t], [p])

    def decode_round(self, stop_fn: RowStopFn | None) -> list[tuple[int, RowOutput]]:
        """Decode up to sync_every steps; return the (slot, output) of each row that finished."""
        r = self.runner
        # no longer than the longest-running row still needs
        left = max(x.request.params.max_new_tokens - len(x.token_ids) for x in self.running.values())  # fmt: skip
        n_steps = max(1, min(r.sync_every, left))
        toks, lps = [], []
        t0, compile_s = time.perf_counter(), 0.0
        for _ in range(n_steps):
            self.state, tok, lp, dt = r.decode(
                self.state, self.rows, self.shape.row_stride, self.greedy_only
            )
            compile_s += dt
            toks.append(tok)
            lps.append(lp)
        # the one host look of the round
        chunk, chunk_lp = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
        n_gen, done = self.state.n_gen.tolist(), self.state.done.tolist()
        r.stats.decode_s += time.perf_counter() - t0 - compile_s

        eos = set(r.eos.tolist())
        finished = []
        for slot, row in list(self.running.items()):
            new = n_gen[slot] - len(row.token_ids)  # a row's live tokens lead the chunk
            row.token_ids += chunk[slot][:new]
            row.logprobs += chunk_lp[slot][:new]
            params = row.request.params
            keep = stop_fn(row.request, row.token_ids) if stop_fn and params.stop else None
            if keep is not None:
                ids, lp, reason = row.token_ids[:keep], row.logprobs[:keep], FinishReason.STOP
                self.state.done[slot] = True
            elif done[slot]:
                ids, lp = row.token_ids, row.logprobs
                stopped = not params.ignore_eos and bool(ids) and ids[-1] in eos
                reason = FinishReason.STOP if stopped else FinishReason.LENGTH
            else:
                continue
            del self.running[slot]
            finished.append((slot, RowOutput(ids, lp, reason)))
        return finished
