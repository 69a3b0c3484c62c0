"""Attention over the paged KV cache for one engine step.

A step is a flat run of T tokens from several sequences: first `num_decodes` single tokens
(one per decoding sequence), then each prefilling sequence's chunk of prompt tokens, packed
with no padding. Every token's key/value is written at its own cache slot first; then

- decodes attend in a few groups of similar context length: each group's blocks are
  gathered into a (B, n_blocks * block_size) batch (n_blocks: the group's longest table,
  padded with the scratch block) and one SDPA call runs with a length mask. Grouping keeps
  the padded blocks few (the gather is the costly part on the CPU: it copies the KV once
  more), while each group stays one batched call;
- each prefill chunk attends on its own: to its own fresh keys/values with a causal SDPA
  when nothing of the sequence is cached yet, else to its blocks (cached prefix or earlier
  chunks + this chunk) with an offset causal mask.

That is the gather path (`DecodeBackend.GATHER`, the CPU's). On CUDA the decodes instead
read the pool in place with FlexAttention (`DecodeBackend.FLEX`, paged_flex.py): one group of
all decodes, its rows padded to a power of two and its block lists to a fixed width, and no copy
of the KV. In the model, the whole of a layer's attention (cache write included) is one
custom op opaque to the compiler (model/attention/op.py), which calls `step_attention`.

Sliding-window models (Mistral) add `query - key < window` to every mask. The masks depend
on the step, not the layer: `StepAttention.with_masks` builds them once per forward and every
layer reuses them (as it reuses the block tables). Grouped-query attention never copies K/V
per query head: decodes fold a kv head's query heads into SDPA's query axis, prefill passes
`enable_gqa=True`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch

from batchgen.model.attention.decode_ops import decode_attention, decode_mask
from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.paged_flex import (
    PagedMask,
    flex_decode_attention,
    list_width,
    pad_rows,
    paged_mask,
)
from batchgen.model.attention.sdpa import DEFAULT, AttnParams, sdpa
from batchgen.model.attention.windows import window_ok


class DecodeBackend(enum.Enum):
    """How decodes read their keys/values; one path per device, chosen by the runner."""

    # copy each row's blocks, then SDPA: the CPU's (issue 41: through its kept buffer, at most
    # a fifth slower a call than inductor's CPU flex at its best, with no compile per row count
    # and no block lists as wide as the pool; docs/benchmarks.md)
    GATHER = "gather"
    FLEX = "flex"  # FlexAttention over the pool in place, no copy (paged_flex.py): CUDA's


# Overrides the device's decode attention path (flex|gather): for tests (flex on the CPU) and
# A/B runs on a GPU. Read when a runner is built; tensor-parallel ranks inherit it.
DECODE_ATTENTION_ENV = "BATCHGEN_DECODE_ATTENTION"


def decode_backend(device: torch.device, block_size: int, head_dim: int) -> DecodeBackend:
    """One decode attention path per device: FlexAttention over the pool in place on CUDA,
    gather + SDPA elsewhere. The CUDA kernel tiles keys by a power of two >= 16 within a
    block and needs head_dim >= 16 (tl.dot); other shapes keep the gather."""
    forced = os.environ.get(DECODE_ATTENTION_ENV)
    if forced:
        try:
            return DecodeBackend(forced)
        except ValueError:
            names = "|".join(b.value for b in DecodeBackend)
            raise ValueError(f"{DECODE_ATTENTION_ENV}={forced!r}: use one of {names}") from None
    fits = block_size >= 16 and block_size & (block_size - 1) == 0 and head_dim >= 16
    return DecodeBackend.FLEX if device.type == "cuda" and fits else DecodeBackend.GATHER


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens within a step."""

    q_start: int  # index of the chunk's first token in the step's flat tokens
    q_len: int
    ctx_start: int  # the sequence's tokens already cached: the chunk sits at positions ctx_start..
    blocks: (
        torch.Tensor | None
    )  # (n,) blocks of positions [0, ctx_start + q_len); None if ctx_start == 0
    mask: torch.Tensor | None = None  # (q_len, S) from with_masks; None: causal over its own keys


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences q_start.. q_start + B - 1 of a step, attended in one call."""

    q_start: int
    blocks: torch.Tensor | None  # (B, n) block tables, padded with the scratch block (None:
    # a compiled flex step's, whose mask comes built)
    lens: torch.Tensor  # (B,) context lengths, this token included
    # From StepAttention.with_masks: gather, a (B, 1, 1, n * block_size) SDPA mask; flex, a
    # PagedMask over the pool (rows padded to a power of two).
    mask: torch.Tensor | PagedMask | None = None


@dataclass(slots=True)
class StepAttention:
    """What the attention layers need to know about a step, shared by all layers. The
    decodes are tokens 0..num_decodes - 1, covered by the groups in order."""

    slots: torch.Tensor  # (T,) flat cache slot of each token's key/value
    num_decodes: int
    decodes: tuple[DecodeGroup, ...] = ()
    prefills: tuple[PrefillSpan, ...] = ()
    backend: DecodeBackend = DecodeBackend.GATHER
    window: int | None = None  # the model's sliding window, set by with_masks
    # flex's own compiled kernel on the CPU too (always on CUDA): a compiled forward's, whose
    # op runs under AOT autograd's dispatch mode, where eager flex's vmap fails
    flex_compiled: bool = False

    def with_masks(
        self, window: int | None, cache: PagedKVCache, queries: int, max_positions: int
    ) -> StepAttention:
        """This step with its groups' and spans' attention masks built, for all layers.
        cache: a layer's cache (its pool's shape); queries: query heads per kv head;
        max_positions: the longest a sequence can be (flex's lists hold its blocks)."""
        width = list_width(cache, max_positions)
        decodes = tuple(self._decode_mask(g, window, cache, queries, width) for g in self.decodes)
        prefills = tuple(
            PrefillSpan(
                s.q_start,
                s.q_len,
                s.ctx_start,
                s.blocks,
                prefill_mask(s, window, self.slots.device),
            )
            for s in self.prefills
        )
        return StepAttention(
            self.slots,
            self.num_decodes,
            decodes,
            prefills,
            self.backend,
            window,
            self.flex_compiled,
        )

    def _decode_mask(
        self, g: DecodeGroup, window: int | None, cache: PagedKVCache, queries: int, width: int
    ) -> DecodeGroup:
        bs = cache.block_size
        if self.backend is DecodeBackend.GATHER:
            mask = decode_mask(g.lens, g.blocks.shape[1] * bs, window)
            return DecodeGroup(g.q_start, g.blocks, g.lens, mask)
        blocks, lens = pad_rows(g.blocks, g.lens)
        mask = paged_mask(blocks, lens, window, cache.num_blocks, bs, width)
        return DecodeGroup(g.q_start, blocks, lens, mask)


def prefill_mask(
    span: PrefillSpan, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """The span's (q_len, ctx_start + q_len) mask; None where plain causal SDPA does."""
    if span.blocks is None and window is None:
        return None
    q_pos = span.ctx_start + torch.arange(span.q_len, device=device)[:, None]  # (n, 1)
    k_pos = torch.arange(span.ctx_start + span.q_len, device=device)[None, :]  # (1, S)
    return (k_pos <= q_pos) & window_ok(q_pos, k_pos, window)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    span: PrefillSpan,
    params: AttnParams = DEFAULT,
) -> torch.Tensor:
    """q (n, H, D) and the chunk's own k, v (n, Hkv, D) -> (n, H, Dv)."""
    n = q.shape[0]
    if span.blocks is not None:  # earlier tokens are cached: read them (and the chunk) back
        k, v = cache.gather(span.blocks)
        k, v = k[: span.ctx_start + n], v[: span.ctx_start + n]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, len, D)
    y = sdpa(qh, kh, vh, span.mask, params, causal=span.mask is None)
    return y[0].transpose(0, 1)


def step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    step: StepAttention,
    params: AttnParams = DEFAULT,
) -> torch.Tensor:
    """q (T, H, D), k, v (T, Hkv, D) of a whole step (masks built) -> (T, H, D). params: a
    scale, soft-cap or sinks (the transformers backend's, Gemma's). Tokens past the decodes
    and prefill chunks (a compiled step's padding, whose slots are the scratch block's) are
    written and get zeros."""
    cache.write(step.slots, k, v)
    bs = cache.block_size
    parts = []
    for g in step.decodes:
        rows = g.lens.shape[0]
        n = min(rows, step.num_decodes - g.q_start)  # a flex group's rows past n: padding
        qg = q[g.q_start : g.q_start + n]
        if step.backend is DecodeBackend.FLEX:
            qg = torch.cat([qg, qg.new_zeros(rows - n, *qg.shape[1:])]) if rows > n else qg
            # on CUDA always: eager flex would score the whole pool
            compiled = qg.device.type == "cuda" or step.flex_compiled
            out = flex_decode_attention(
                qg, cache.k, cache.v, g.mask, step.window, bs, compiled, params
            )
            parts.append(out[:n])
        else:
            buf = cache.gather_buffer()
            parts.append(decode_attention(qg, cache.k, cache.v, bs, g.blocks, g.mask, params, buf))
    for s in step.prefills:
        sl = slice(s.q_start, s.q_start + s.q_len)
        parts.append(prefill_attention(q[sl], k[sl], v[sl], cache, s, params))
    pad = q.shape[0] - sum(p.shape[0] for p in parts)
    if pad:  # padding tokens
        parts.append(q.new_zeros(pad, q.shape[1], v.shape[2]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
