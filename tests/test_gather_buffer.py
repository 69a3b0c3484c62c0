"""The CPU's gather buffer (model/attention/kv_cache.py, issue 41): decodes gathered a few rows
at a time into one kept buffer, and prefill contexts copied into it where they fit, give
bitwise the attention of a fresh gather, and never allocate a new buffer; its size follows
the thread count up to a cap."""

import pytest
import torch

from batchgen.model.attention import kv_cache
from batchgen.model.attention.kv_cache import PagedKVCache, gather_blocks
from batchgen.model.attention.sdpa import AttnParams
from batchgen.model.attention.step import (
    PrefillSpan,
    decode_attention,
    decode_mask,
    prefill_attention,
    prefill_mask,
)


def _cache(bs=4, hkv=2, d=8, num_blocks=40) -> PagedKVCache:
    torch.manual_seed(0)
    cache = PagedKVCache(num_blocks, bs, hkv, d, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    return cache


@pytest.mark.parametrize("params", [AttnParams(), AttnParams(softcap=5.0)])
@pytest.mark.parametrize("window", [None, 6])
def test_decodes_through_the_buffer_equal_a_fresh_gather(window, params, monkeypatch):
    cache = _cache()
    lens = torch.tensor([13, 5, 1, 8, 16, 11, 2])
    tables = torch.randperm(39)[:28].view(7, 4) + 1
    q = torch.randn(7, 4, 8)
    mask = decode_mask(lens, 4 * 4, window)
    want = decode_attention(q, cache.k, cache.v, 4, tables, mask, params)
    row = 2 * 4 * 4 * 2 * 8 * 4  # bytes of one row's K and V
    for rows in (1, 3, 7):  # rows per gather: 7 calls, 3 (of 3, 3, 1), one
        monkeypatch.setattr(kv_cache, "gather_bytes", lambda threads, n=rows * row: n)
        cache._buffer = None
        buf = cache.gather_buffer()
        got = decode_attention(q, cache.k, cache.v, 4, tables, mask, params, buf)
        assert torch.equal(got, want)
        assert cache.gather_buffer() is buf  # one buffer, kept
    monkeypatch.setattr(kv_cache, "gather_bytes", lambda threads: row // 2)  # a row too long
    cache._buffer = None
    got = decode_attention(q, cache.k, cache.v, 4, tables, mask, params, cache.gather_buffer())
    assert torch.equal(got, want)


def test_a_prefill_context_goes_through_the_buffer_where_it_fits(monkeypatch):
    cache = _cache()
    blocks = torch.tensor([7, 2, 9])
    k, v = gather_blocks(cache.k, cache.v, blocks, 4)  # fresh: the reference
    got = cache.gather(blocks)
    buf = cache.gather_buffer()
    assert got[0].data_ptr() == buf.data_ptr()  # into the buffer, K then V
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    q, kn, vn = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    span = PrefillSpan(0, 6, 4, blocks)
    span.mask = prefill_mask(span, None, q.device)
    want = prefill_attention(q, kn, vn, cache, span)
    monkeypatch.setattr(kv_cache, "gather_bytes", lambda threads: 64)  # too small: a fresh copy
    cache._buffer = None
    k2, _ = cache.gather(blocks)
    assert k2.data_ptr() != cache.gather_buffer().data_ptr() and torch.equal(k2, k)
    assert torch.equal(prefill_attention(q, kn, vn, cache, span), want)


def test_the_buffer_grows_with_the_threads_up_to_its_cap(monkeypatch):
    mib = 1 << 20
    sizes = [kv_cache.gather_bytes(t) for t in (1, 2, 4, 8, 64)]
    assert sizes == [4 * mib, 4 * mib, 8 * mib, 16 * mib, 16 * mib]  # 2 cores: 4 MiB as before
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert _cache().gather_buffer().numel() * 4 == 8 * mib  # float32, sized at first use


def test_no_buffer_off_the_cpu():
    assert PagedKVCache(4, 4, 2, 8, torch.float32, "meta").gather_buffer() is None
