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

Sliding-window models (Mistral) add `query - key < window` to every mask. The masks depend
on the step, not the layer: `StepAttention.with_masks` builds them once per forward and every
layer reuses them (as it reuses the block tables). Grouped-query attention never copies K/V
per query head: decodes fold a kv head's query heads into SDPA's query axis, prefill passes
`enable_gqa=True`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from batchgen.model.kv_cache import PagedKVCache


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
    blocks: torch.Tensor  # (B, n) block tables, padded with the scratch block
    lens: torch.Tensor  # (B,) context lengths, this token included
    # from StepAttention.with_masks: (B, 1, 1, n * block_size) for SDPA, or a BlockMask
    mask: torch.Tensor | BlockMask | None = None


@dataclass(slots=True)
class StepAttention:
    """What the attention layers need to know about a step, shared by all layers. The
    decodes are tokens 0..num_decodes - 1, covered by the groups in order."""

    slots: torch.Tensor  # (T,) flat cache slot of each token's key/value
    num_decodes: int
    decodes: tuple[DecodeGroup, ...] = ()
    prefills: tuple[PrefillSpan, ...] = ()
    flex: bool = False  # decodes read the pool in place (tables padded to the pool's width)

    def with_masks(self, window: int | None, block_size: int, gqa: int = 1) -> StepAttention:
        """This step with its groups' and spans' attention masks built, for all layers
        (gqa: query heads per kv head)."""
        decodes = tuple(
            DecodeGroup(
                g.q_start,
                g.blocks,
                g.lens,
                g.mask  # built already (the compiled decode step takes it as an input)
                if g.mask is not None
                else paged_block_mask(g.blocks, g.lens, window, block_size, gqa)
                if self.flex
                else decode_mask(g.lens, g.blocks.shape[1] * block_size, window),
            )
            for g in self.decodes
        )
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
        return StepAttention(self.slots, self.num_decodes, decodes, prefills, self.flex)


def _window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    return (q_pos - k_pos) < window if window is not None else torch.ones_like(k_pos, dtype=torch.bool)  # fmt: skip


def decode_mask(lens: torch.Tensor, s: int, window: int | None) -> torch.Tensor:
    """(B,) context lengths over s gathered key slots -> (B, 1, 1, s) SDPA mask."""
    k_pos = torch.arange(s, device=lens.device)[None, :]  # (1, S)
    q_pos = (lens - 1)[:, None]  # (B, 1)
    return ((k_pos <= q_pos) & _window_ok(q_pos, k_pos, window))[:, None, None, :]


def _flex_queries(gqa: int) -> int:
    # GQA folded as in decode_attention: a kv head's query heads are its queries. With one
    # query the CPU picks its flash-decoding kernel, which scans the whole pool when rows
    # differ in length; two copies of the query keep it on the blocked kernel.
    return max(gqa, 2)


def paged_block_mask(
    tables: torch.Tensor, lens: torch.Tensor, window: int | None, block_size: int, gqa: int
) -> BlockMask:
    """A FlexAttention block mask for decodes that read the pool in place: row b's query
    attends to positions [lo, len) of its table (lo = len - window, or 0), i.e. to the
    physical blocks tables[b, j] ((B, pool blocks) int32, one flex KV block per cache
    block). Blocks wholly inside go to the "full" lists, which the kernels read without
    mask_mod; at most two are partial (the ones holding lo and len - 1).

    mask_mod itself is exact for every key of the pool (eager flex_attention evaluates it
    densely): a physical block's logical index comes from one map for the step, `logical`
    (pool blocks + 1,), which is well defined because a block sits at the same index in
    every table that holds it (a prefix-cache key names the block's whole prefix), and
    `tables[b, logical[blk]] == blk` checks that row b holds it. mask_mod reads only
    tensors that are graph inputs or a scatter's output (`tables`, `lens`, `logical`):
    inductor's CPU kernel takes no computed-but-unmaterialised tensor into mask_mod."""
    bs, (rows, width), q_len = block_size, tables.shape, _flex_queries(gqa)
    n32 = lens.to(torch.int32)
    lo = (n32 - window).clamp(min=0) if window is not None else torch.zeros_like(n32)
    cols = torch.arange(width, device=tables.device, dtype=torch.int32)
    held = cols[None] < ((n32 + bs - 1) // bs)[:, None]  # (B, W)
    logical = torch.zeros(width + 1, dtype=torch.int32, device=tables.device)
    logical.scatter_(0, torch.where(held, tables, width).flatten().long(), cols.expand(rows, width).flatten())  # fmt: skip
    full_lo, full_hi = (lo + bs - 1) // bs, n32 // bs  # full blocks: j in [full_lo, full_hi)
    full_n = (full_hi - full_lo).clamp(min=0)
    # full blocks start at full_lo (0 without a window): each row shifted left. (Also a
    # buffer apart from `tables`: the CPU kernel fails to build when mask_mod reads the
    # same buffer as the block lists.)
    full_idx = tables.gather(1, (cols[None] + full_lo[:, None]).clamp(max=width - 1).long())
    first_j, last_j = lo // bs, (n32 - 1) // bs
    has_first, has_last = lo % bs != 0, n32 % bs != 0
    part_n = has_first.to(torch.int32) + (has_last & ~(has_first & (first_j == last_j))).to(torch.int32)  # fmt: skip
    part_idx = torch.zeros_like(tables)
    part_idx[:, 0] = tables.gather(1, torch.where(has_first, first_j, last_j)[:, None].long())[:, 0]
    part_idx[:, 1] = tables.gather(1, last_j[:, None].long())[:, 0]

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // bs
        j = logical[blk]
        pos = j * bs + kv_idx % bs
        ok = (tables[b, j] == blk) & (pos < lens[b])
        return ok & (pos + window >= lens[b]) if window is not None else ok

    return BlockMask.from_kv_blocks(
        part_n[:, None, None],
        part_idx[:, None, None, :],
        full_n[:, None, None],
        full_idx[:, None, None, :],
        BLOCK_SIZE=(q_len, bs),
        mask_mod=mask_mod,
        seq_lengths=(q_len, width * bs),
        compute_q_blocks=False,
    )


def prefill_mask(span: PrefillSpan, window: int | None, device: torch.device) -> torch.Tensor | None:  # fmt: skip
    """The span's (q_len, ctx_start + q_len) mask; None where plain causal SDPA does."""
    if span.blocks is None and window is None:
        return None
    q_pos = span.ctx_start + torch.arange(span.q_len, device=device)[:, None]  # (n, 1)
    k_pos = torch.arange(span.ctx_start + span.q_len, device=device)[None, :]  # (1, S)
    return (k_pos <= q_pos) & _window_ok(q_pos, k_pos, window)


def decode_attention(
    q: torch.Tensor, cache: PagedKVCache, blocks: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q (B, H, D), one query per sequence, over its blocks (B, n) -> (B, H, D)."""
    b, h, d = q.shape
    k, v = cache.gather(blocks)  # (B, S, Hkv, D)
    hkv = k.shape[2]
    # Grouped-query attention folded into the query axis: the g query heads of a kv head
    # are its g "query positions", (B, Hkv, g, D), so K/V need no copy per query head.
    y = F.scaled_dot_product_attention(
        q.view(b, hkv, h // hkv, d),
        k.transpose(1, 2),  # (B, Hkv, S, D)
        v.transpose(1, 2),
        attn_mask=mask,
    )
    return y.reshape(b, h, d)


@functools.cache
def _compiled_flex():
    # dynamic=False: on the CPU inductor's dynamic-shape flex kernel fails to build (torch
    # 2.13), so each decode batch size is one compile; callers pad to powers of two.
    return torch.compile(flex_attention, dynamic=False)


def flex_decode_attention(q: torch.Tensor, cache: PagedKVCache, mask: BlockMask) -> torch.Tensor:
    """q (B, H, D), one query per sequence, reading the pool in place -> (B, H, D)."""
    b, h, d = q.shape
    hkv = cache.k.shape[1]
    g = h // hkv
    # The pool as one (1, Hkv, num_blocks * block_size, D) sequence, a view: no copy.
    k, v = (x.permute(1, 0, 2)[None] for x in (cache.k, cache.v))
    # The softmax scale applied to q: this makes q a (B, Hkv, queries, D) tensor of its own,
    # which inside a compiled graph inductor's CPU template needs (it reads the query's
    # storage as 4-d; a view of the (B, H, D) q, even cloned, fails to lower).
    qf = q.view(b, hkv, g, d).expand(b, hkv, _flex_queries(g), d) * d**-0.5
    y = _compiled_flex()(qf, k, v, block_mask=mask, scale=1.0)
    return y[:, :, :g].reshape(b, h, d)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    span: PrefillSpan,
) -> torch.Tensor:
    """q (n, H, D) and the chunk's own k, v (n, Hkv, D) -> (n, H, D)."""
    n = q.shape[0]
    if span.blocks is not None:  # earlier tokens are cached: read them (and the chunk) back
        k, v = cache.gather(span.blocks)
        k, v = k[: span.ctx_start + n], v[: span.ctx_start + n]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, len, D)
    y = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True
    )
    return y[0].transpose(0, 1)


def step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    step: StepAttention,
) -> torch.Tensor:
    """q (T, H, D), k, v (T, Hkv, D) of a whole step (masks built) -> (T, H, D)."""
    cache.write(step.slots, k, v)
    parts = []
    for g in step.decodes:
        if isinstance(g.mask, BlockMask):  # tables padded past the decodes: pad q likewise
            n = min(g.lens.shape[0], step.num_decodes - g.q_start)
            qg = q[g.q_start : g.q_start + n]
            if n < g.lens.shape[0]:
                qg = torch.cat([qg, qg.new_zeros(g.lens.shape[0] - n, *qg.shape[1:])])
            parts.append(flex_decode_attention(qg, cache, g.mask)[:n])
            continue
        qg = q[g.q_start : g.q_start + g.lens.shape[0]]
        parts.append(decode_attention(qg, cache, g.blocks, g.mask))
    for s in step.prefills:
        sl = slice(s.q_start, s.q_start + s.q_len)
        parts.append(prefill_attention(q[sl], k[sl], v[sl], cache, s))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
