"""Decode attention that reads the paged KV pool in place: FlexAttention with a paged block mask.

Why: the gather path (model/attention/step.py, `decode_attention`) copies every row's blocks into a
new (B, S, Hkv, D) tensor in each layer, each step, then runs SDPA over the copy: three trips over
the KV (read the pool, write the copy, read it back) where attention needs one. On a GPU,
where decode is bound by memory bandwidth, that copy is most of the attention's cost
(docs/architecture.md has the bytes). Here the pool itself, viewed as one sequence of
num_blocks * block_size keys, is FlexAttention's key/value; a block mask tells the kernel which
of those blocks each row reads, so nothing is copied. This is what the CUDA runner uses; the
CPU keeps gather + SDPA (issue 41: inductor's CPU flex template, compiled, is no faster than a
gather through a kept buffer with this mask, and at most a fifth faster with "full" block lists,
for a compile per row count and lists as wide as the pool; docs/benchmarks.md).

The block mask. Row b's kv block list is its block table, from the first block inside its
sliding window (0 without one) to the block of its last token: the kernel visits only those
cache blocks, one flex KV block per cache block. Every listed block goes through `mask_mod`;
there are no "full" lists, because with them the CUDA decoding kernel splits the length of the
whole pool across its KV splits (flex_decode.py.jinja, TILE_KV) instead of the row's own blocks.
`mask_mod` maps a physical key slot back to its logical position: cache block blk sits at index
`logical[blk]` of every table that holds it (a shared block is a prefix-cache block, which
names its whole prefix, so its index is the same in every table), and `tables[b, j] == blk`
checks that row b holds it. The position must be below the row's length and, with a window,
within `window` of its last token: the masks of `decode_mask` exactly. Eager flex_attention
evaluates `mask_mod` densely over the whole pool (no block sparsity), so it is exact for every
key, listed or not; for the same reason the eager call is never used on a GPU (it would
materialise (B, H, pool) scores): there the call is always compiled.

Grouped-query attention is folded into the query axis, as in `decode_attention`: the g query
heads of a kv head are its g queries, q (B, Hkv, g, D). The CUDA decoding kernel packs them
into one tile just as `enable_gqa=True` would (it reshapes (B, Hq, 1, D) to (B, Hkv, g, 1, D)),
but folding also takes g that is not a power of two (Qwen2-7B: 28 / 4 = 7), which its
enable_gqa path refuses. Shapes are bounded: a group's rows are padded to a power of two
(padding rows read one key of the scratch block) and its lists and tables are widened, on the
device, to one width for the model (`list_width`), so the compiled kernel sees one shape per row
count, whatever the contexts.

A layer's own attention (sdpa.AttnParams, the transformers backend's) goes into the same
kernel: its scale into q (the compiled call) or flex's `scale` (eager); a soft-cap as a
`score_mod`, cap * tanh(score / cap), one function object per cap value so the compiled kernel
is reused across layers and steps; sinks from the log-sum-exp flex returns, since a sink adds
exp(sink) to the softmax's denominator and nothing to its numerator: out * Z / (Z + e^sink) =
out * sigmoid(lse - sink), per query head, exact.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.sdpa import DEFAULT, AttnParams
from batchgen.model.attention.windows import first_key

# The CUDA decoding kernel needs the mask's query block size to be a multiple of its query
# tile (>= 16 and >= the queries, next power of two): 128, flex's default, covers g <= 128.
Q_BLOCK = 128
# Row counts the kernel is compiled for: the powers of two up to 2**12 (a static batch each,
# which the decoding kernel needs), so at most 13 a variant, whatever the job. A variant: each
# window value (its mask_mod), soft-cap value (score_mod) and sinks (the log-sum-exp asked),
# which a model's layers may mix (Gemma 2: a window and full layers, a soft-cap). Past this
# limit dynamo would run flex eagerly: scores over the whole pool on CUDA.
_MAX_FLEX_SIZES = 64


def pad_rows(tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables (B, W) and lengths (B,) with the rows padded to a power of two: padding rows
    hold the scratch block (0) with length 1."""
    rows = tables.shape[0]
    r = 1 << (rows - 1).bit_length()
    if r == rows:
        return tables, lens
    return (
        torch.cat([tables, tables.new_zeros(r - rows, tables.shape[1])]),
        torch.cat([lens, lens.new_ones(r - rows)]),
    )


def list_width(cache: PagedKVCache, max_positions: int) -> int:
    """The width of every block list (and table) a flex mask carries. Fixed for a model, so
    the kernel has no table-width axis: the most blocks a sequence can hold; on the CPU the
    whole pool (inductor's CPU kernel wants the lists as long as the keys)."""
    if cache.k.device.type == "cpu":
        return cache.num_blocks
    return min(cache.num_blocks, -(-max_positions // cache.block_size))


@dataclass(slots=True)
class PagedMask:
    """A paged block mask as plain tensors, built once a step and shared by every layer; its
    rows padded to a power of two (R). Each layer's attention op makes the BlockMask of them."""

    num: torch.Tensor  # (R,) int32: blocks listed per row
    indices: torch.Tensor  # (R, W) int32: the listed blocks, the first read first
    logical: torch.Tensor  # (pool + 1,) int32: a block's index in the tables that hold it
    tables: torch.Tensor  # (R, W) int32: each row's block table
    lens: torch.Tensor  # (R,) int32: each row's context length, this token included

    @property
    def rows(self) -> int:
        return self.lens.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.num, self.indices, self.logical, self.tables, self.lens


def paged_mask(
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int | None,
    pool_blocks: int,
    bs: int,
    width: int,
) -> PagedMask:
    """The mask of decode rows reading a pool of pool_blocks blocks of bs slots in place:
    tables (R, n) padded with the scratch block, lens (R,) context lengths (this token
    included); width: the lists' fixed width (`list_width`)."""
    tables, lens = tables[:, :width].to(torch.int32), lens.to(torch.int32)
    rows, n = tables.shape  # columns past width: padding (no sequence holds more blocks)
    cols = torch.arange(n, dtype=torch.int32, device=tables.device)
    lo = (torch.zeros_like(lens) + first_key(lens - 1, window)).clamp(min=0)  # (R,)
    first, last = lo // bs, (lens - 1) // bs  # (R,) the first and last block read
    num = last - first + 1
    # The listed blocks, shifted to start at `first`: a buffer of its own, apart from `tables`
    # (inductor's CPU kernel fails to build when mask_mod reads the block list's buffer).
    kv_indices = tables.gather(1, (cols[None] + first[:, None]).clamp(max=n - 1).long())
    # logical[blk]: blk's index in the tables that hold it; unheld slots go to a spare entry.
    held = cols[None] <= last[:, None]
    logical = torch.zeros(pool_blocks + 1, dtype=torch.int32, device=tables.device)
    target = torch.where(held, tables, pool_blocks).flatten().long()
    logical.scatter_(0, target, cols.expand(rows, n).flatten())
    if n < width:  # to the fixed width: a few bytes a row, on the device
        tables, kv_indices = (
            torch.cat([x, x.new_zeros(rows, width - n)], 1) for x in (tables, kv_indices)
        )
    return PagedMask(num, kv_indices, logical, tables, lens)


def block_mask(m: PagedMask, window: int | None, bs: int, queries: int) -> BlockMask:
    """m as flex's BlockMask over the pool (no kernel runs: Python objects around m's
    tensors); queries: the folded query axis (query heads per kv head)."""
    logical, tables, lens = m.logical, m.tables, m.lens
    pool_blocks = logical.shape[0] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // bs
        j = logical[blk]
        pos = j * bs + kv_idx % bs  # the key's position in row b's sequence, if b holds blk
        ok = (tables[b, j] == blk) & (pos < lens[b])
        return ok & (pos >= first_key(lens[b] - 1, window)) if window is not None else ok

    return BlockMask.from_kv_blocks(
        m.num[:, None, None],  # (R, 1, 1): one head group, one query block
        m.indices[:, None, None, :],
        BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=mask_mod,
        seq_lengths=(queries, pool_blocks * bs),
        compute_q_blocks=False,
    )


# The CUDA decoding kernel's options by device capability, over inductor's own choice (on sm90
# at bf16 it picks num_stages 1, num_warps 2) and BLOCK_N, the key tile, at most the cache
# block (so the block mask's KV block, one cache block, is a multiple of it). Not yet measured
# on any GPU: the entries are empty until scripts/gpu_check.sh's sweep
# (bench_paged_decode.py --options) shows a better set in GB/s. FLEX_OPTIONS_ENV overrides
# them, for that sweep and for A/B runs: a JSON object, e.g. '{"num_warps": 4, "BLOCK_N": 16}'.
FLEX_OPTIONS: dict[tuple[int, int], dict[str, int]] = {(8, 0): {}, (9, 0): {}, (10, 0): {}}
FLEX_OPTIONS_ENV = "BATCHGEN_FLEX_OPTIONS"
_OPTION_NAMES = ("num_stages", "num_warps", "BLOCK_N")


@functools.cache
def kernel_options(capability: tuple[int, int], block_size: int, env: str | None) -> dict:
    """The decoding kernel's options on a device of this capability (FLEX_OPTIONS), with
    env (FLEX_OPTIONS_ENV's value) over them; one line naming the fix for a bad override."""
    opts = {"BLOCK_N": min(block_size, 64), **FLEX_OPTIONS.get(capability, {})}
    if env:
        try:
            given = json.loads(env)
        except json.JSONDecodeError:
            given = None
        ok = isinstance(given, dict) and all(
            k in _OPTION_NAMES and isinstance(v, int) and v > 0 for k, v in given.items()
        )
        if not ok or block_size % given.get("BLOCK_N", 1):
            names = ", ".join(_OPTION_NAMES)
            raise ValueError(
                f"{FLEX_OPTIONS_ENV}={env!r}: give a JSON object of positive integers among "
                f"{names}, BLOCK_N dividing the block size {block_size}"
            )
        opts.update(given)
    return opts


@functools.cache
def _flex_sizes():
    """Dynamo's recompile limit raised for this kernel's calls only (one compile a row count);
    one patch object, reused: made anew each call it cost 17 us, a layer's call, a step."""
    import torch._dynamo  # only here: an eager job never pays its import

    return torch._dynamo.config.patch(recompile_limit=_MAX_FLEX_SIZES)


@functools.cache
def _compiled_flex():
    # dynamic=False: the CUDA decoding kernel needs a static batch (inductor picks the main
    # flex template, which pads the queries to its tile and has no split-KV, for a symbolic
    # one); callers pad rows to powers of two, so the sizes are few.
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _softcap(cap: float):
    """The score_mod of a soft-cap: one object per value, so compiled kernels are reused."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def flex_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    m: PagedMask,
    window: int | None,
    bs: int,
    compiled: bool,
    params: AttnParams = DEFAULT,
) -> torch.Tensor:
    """q (R, H, D), one query per row (R: the mask's rows), over the pools (slots, Hkv, D)
    in place -> (R, H, D). compiled: flex's own compiled kernel (at the static row count; on
    CUDA always, since eager flex materialises (R, H, pool) scores), else eager flex (exact
    for every key: the CPU tests'). params: the layer's scale, soft-cap and sinks."""
    r, h, d = q.shape
    hkv = k_pool.shape[1]
    # The pool as one (1, Hkv, num_blocks * block_size, D) sequence: a view, no copy. Its
    # batch of 1 broadcasts over the rows (the kernels index K/V by batch % 1).
    k, v = (x.permute(1, 0, 2)[None] for x in (k_pool, v_pool))
    mask = block_mask(m, window, bs, h // hkv)
    scale = params.scale if params.scale is not None else d**-0.5
    kw = {"block_mask": mask}
    if params.softcap is not None:
        kw["score_mod"] = _softcap(float(params.softcap))
    if params.sinks is not None:
        # (inductor's CPU flex template returns no log-sum-exp in torch 2.13, so a compiled
        # flex with sinks runs on CUDA only; the CPU's decode path is the gather)
        kw["return_aux"] = AuxRequest(lse=True)
    if not compiled:
        qf = q.reshape(r, hkv, h // hkv, d)  # (R, Hkv, g, D): GQA folded into the query axis
        out = flex_attention(qf, k, v, scale=scale, **kw)
        return _sunk(out, params.sinks).reshape(r, h, d)
    # Inductor's CPU template reads q's storage as 4-d: a view of the (R, H, D) q fails to
    # lower (torch 2.13), so the folded q is a copy of its own; the softmax scale goes to the
    # kernel, which applies it in float32 (q pre-scaled in bf16 lost bits to the rounding).
    qf = q.reshape(r, hkv, h // hkv, d).clone()
    opts = None
    if q.device.type == "cuda":
        cap = torch.cuda.get_device_capability(q.device)
        opts = kernel_options(cap, bs, os.environ.get(FLEX_OPTIONS_ENV))
    from torch._dynamo.utils import counters  # (imported with dynamo by _flex_sizes)

    before = counters["stats"]["unique_graphs"]
    with _flex_sizes():
        out = _compiled_flex()(qf, k, v, scale=scale, kernel_options=opts, **kw)
    # its compiles counted apart, so the forward's own count stays the model's graphs
    counters["batchgen"]["flex_graphs"] += counters["stats"]["unique_graphs"] - before
    return _sunk(out, params.sinks).reshape(r, h, d)


def _sunk(out, sinks: torch.Tensor | None) -> torch.Tensor:
    """flex's output, (R, Hkv, g, D), with each query head's sink in its softmax: out *
    sigmoid(lse - sink); as it is without sinks (out is then the tensor alone)."""
    if sinks is None:
        return out
    out, aux = out
    hkv, g = out.shape[1], out.shape[2]
    keep = torch.sigmoid(aux.lse.float() - sinks.float().view(hkv, g))  # (R, Hkv, g)
    return (out.float() * keep[..., None]).to(out.dtype)
