"""Packed sequences over a paged cache (``attention_varlen(..., block_table=)``) and ALiBi on the
cache call, on the host path: the same answer as the contiguous call, every value checked."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import paginate

import cupyflash


def _packed(rng, lengths, hkv=2, d=16):
    return [rng.standard_normal((sum(lengths), hkv, d)) for _ in range(2)]


def _pages(rng, packed, lengths, page_size):
    """The packed rows of each sequence in shuffled pages, one block-table row per sequence."""
    width = max(-(-n // page_size) for n in lengths)
    per_seq = []
    start = 0
    for n in lengths:
        rows = [np.zeros((width * page_size, *x.shape[1:])) for x in packed]
        for r, x in zip(rows, packed):
            r[:n] = x[start : start + n]
        per_seq.append(rows)
        start += n
    stacked = [np.stack([s[i] for s in per_seq]) for i in range(2)]  # [B, width * page_size, H, d]
    return paginate(rng, stacked, page_size)


@pytest.mark.parametrize("page_size", [1, 4, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_equals_contiguous(rng, page_size, causal):
    q_lens, k_lens = [3, 0, 9, 1], [10, 0, 9, 30]
    k, v = _packed(rng, k_lens)
    q = rng.standard_normal((sum(q_lens), 4, 16))
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    (k_pages, v_pages), table = _pages(rng, (k, v), k_lens, page_size)
    seqused = np.array([7, 0, 9, 12], dtype=np.int32)
    for used in (None, seqused):
        want, want_lse = cupyflash.attention_varlen(
            q, k, v, cu_q, cu_k, 9, 30, causal=causal, seqused_k=used, return_lse=True
        )
        got, lse = cupyflash.attention_varlen(
            q, k_pages, v_pages, cu_q, cu_k, 9, 30, causal=causal, seqused_k=used, block_table=table, return_lse=True
        )
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_paged_varlen_checks_its_inputs(rng):
    k_pages = rng.standard_normal((4, 8, 2, 16))
    q = rng.standard_normal((5, 4, 16))
    cu_q = np.array([0, 2, 5], dtype=np.int32)
    cu_k = np.array([0, 9, 20], dtype=np.int32)
    table = np.array([[0, 1], [2, 3]], dtype=np.int32)
    call = lambda **kw: cupyflash.attention_varlen(  # noqa: E731
        q, kw.get("k", k_pages), kw.get("k", k_pages), cu_q, kw.get("cu_k", cu_k), 3, kw.get("max_k", 11),
        block_table=kw.get("table", table),
    )  # fmt: skip
    call()  # well formed
    with pytest.raises(ValueError, match="points outside"):
        call(table=np.array([[0, 1], [2, 7]], dtype=np.int32))
    with pytest.raises(ValueError, match="longer than its max_seqlen"):
        call(cu_k=np.array([0, 9, 26], dtype=np.int32))
    with pytest.raises(ValueError, match="4-D pages"):
        call(k=rng.standard_normal((20, 2, 16)))
    with pytest.raises(ValueError, match="block_table must be 2-D"):
        call(table=np.array([[0, 1]], dtype=np.int32))
    with pytest.raises(ValueError, match="power of two"):
        call(k=rng.standard_normal((4, 6, 2, 16)))
    with pytest.raises(ValueError, match="exceed"):
        call(max_k=17)  # a sequence cannot hold more keys than its table row
    with pytest.raises(ValueError, match="dropout over a paged cache"):
        cupyflash.attention_varlen(q, k_pages, k_pages, cu_q, cu_k, 3, 11, block_table=table, dropout_p=0.1)


@pytest.mark.parametrize("nq", [1, 20])
def test_kvcache_alibi_on_the_host(rng, nq):
    """ALiBi slopes on the cache call: attention with the same slopes over each sequence's keys."""
    b, length, hq, hkv, d = 2, 64, 4, 2, 16
    q = rng.standard_normal((b, nq, hq, d))
    k, v = (rng.standard_normal((b, length, hkv, d)) for _ in range(2))
    slopes = rng.uniform(0, 0.5, (b, hq)).astype(np.float32)
    cached = np.array([length - nq, 30], dtype=np.int32)
    out = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=cached, alibi_slopes=slopes, causal=True)
    for i, n in enumerate(cached):
        want = cupyflash.attention(
            q[i : i + 1], k[i : i + 1, :n], v[i : i + 1, :n], causal=True, alibi_slopes=slopes[i : i + 1]
        )
        np.testing.assert_allclose(out[i : i + 1], want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=cached, alibi_slopes=slopes[0, :3])


def test_paged_varlen_refuses_gradients(rng):
    """No backward over a paged cache: tensors that require grad are refused, never detached."""
    torch = pytest.importorskip("torch")
    pages = torch.randn(4, 8, 2, 16, dtype=torch.float64, requires_grad=True)
    q = torch.randn(5, 4, 16, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 9, 20], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="attention_varlen with a block_table has no backward pass"):
        cupyflash.attention_varlen(q, pages, pages, cu_q, cu_k, 3, 11, block_table=table)
