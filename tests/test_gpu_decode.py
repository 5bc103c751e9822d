"""FlashDecoding on the GPU: attention_with_kvcache and merge_states against the float64
reference, paged against contiguous caches, the in-place append, the split count, CUDA-graph
capture, and the input checks. Outputs are NaN-poisoned before every launch (conftest)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import BOUND, capture, check_kvcache, kv_reference, need_torch, rel_error

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu


def _paginate(torch, caches, page_size, gen):
    """Caches [B, L, H, d] as pages [num_pages, page_size, H, d] in shuffled order (plus two
    spare pages of noise) through one block table [B, ceil(L / page_size)]."""
    b, length, h, d = caches[0].shape
    per_seq = -(-length // page_size)
    num_pages = b * per_seq + 2
    table = torch.randperm(num_pages, generator=gen)[: b * per_seq].reshape(b, per_seq)
    paged = []
    for cache in caches:
        pages = torch.randn(num_pages, page_size, h, d, generator=gen).to(cache.device, cache.dtype)
        padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per_seq * page_size - length))
        pages[table.flatten().to(cache.device)] = padded.reshape(b * per_seq, page_size, h, d)
        paged.append(pages)
    return paged, table.to(caches[0].device, torch.int32)


# (Nq, Hq, Hkv, causal): one token with GQA 4 (the benchmark's rows), speculative tokens with
# causal masking, MHA, and MQA with 16 tokens (128 packed rows: several m-blocks); past 16 query
# tokens (chunked prefill against the cache) the FA2 kernel over the cache view: 17 (one ragged
# query block), 150 (two blocks, causal), MHA not causal.
ROWS = {
    "nq1-gqa4": (1, 8, 2, True),
    "nq3-gqa4-causal": (3, 8, 2, True),
    "nq5-mha": (5, 2, 2, False),
    "nq16-mqa8-causal": (16, 8, 1, True),
    "nq17-gqa4-causal": (17, 8, 2, True),
    "nq150-gqa4-causal": (150, 8, 2, True),
    "nq40-mha": (40, 2, 2, False),
}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("rows", list(ROWS), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_matches_reference(rng, dtype, head_dim, rows, paged):
    _check_decode(rng, dtype, head_dim, rows, 16 if paged else 0)


@pytest.mark.parametrize("page_size", [0, 1, 16], ids=["contiguous", "paged1", "paged16"])
@pytest.mark.parametrize("rows", ["nq1-gqa4", "nq16-mqa8-causal", "nq40-mha"], ids=str)
@pytest.mark.parametrize("head_dim", [8, 32, 59, 80, 96, 160, 224])
def test_decode_head_dims_below_a_tile_width(rng, head_dim, rows, page_size):
    """The next tile width's decode and append kernels with the columns past head_dim zero in
    shared memory and never stored (multiples of 8 in 16-byte chunks, others element by element)."""
    _check_decode(rng, "bfloat16", head_dim, rows, page_size)


def _check_decode(rng, dtype, head_dim, rows, page_size):
    """Append ROWS[rows]' tokens to ragged caches (contiguous, or paged when page_size > 0) and
    attend: the output and the LSE against the float64 reference over the caches as they should
    read after the append; a contiguous cache is also compared with that, bit for bit."""
    paged = page_size > 0
    torch = need_torch()
    nq, hq, hkv, causal = ROWS[rows]
    b, length, nnew = 4, 1031, nq
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", tdtype)
    k, v = (torch.randn(b, length, hkv, head_dim, generator=gen).to("cuda", tdtype) for _ in range(2))
    k_new, v_new = (torch.randn(b, nnew, hkv, head_dim, generator=gen).to("cuda", tdtype) for _ in range(2))
    cached = [0, 1, 500, length - nnew]  # ragged, with an empty and a one-token cache
    seqlens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    expected_k, expected_v = k.clone(), v.clone()
    for i, n in enumerate(cached):
        expected_k[i, n : n + nnew], expected_v[i, n : n + nnew] = k_new[i], v_new[i]
    table = None
    k_cache, v_cache = k, v
    if paged:
        (k_cache, v_cache), table = _paginate(torch, (k, v), page_size, gen)
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new, causal=causal,
        return_lse=True,
    )  # fmt: skip
    assert type(out) is type(q) and out.dtype == q.dtype and out.shape == q.shape
    check_kvcache(out, lse, q, expected_k, expected_v, [n + nnew for n in cached], causal, dtype)
    if not paged:
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("page_size", [1, 2, 16, 64, 256])
def test_paged_equals_contiguous(rng, page_size):
    """Same data, same splits: a paged cache (pages in shuffled order) gives the same bits."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 3, 1024, 16, 4, 128  # a whole number of pages of every size: same splits
    q = torch.randn(b, 2, hq, d, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(b, length, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([1000, 1, 400], dtype=torch.int32, device="cuda")
    (k_pages, v_pages), table = _paginate(torch, (k, v), page_size, gen)
    for splits in (1, 5):
        dense = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=splits, causal=True)
        paged = cupyflash.attention_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, num_splits=splits, causal=True
        )
        assert torch.equal(dense, paged), f"page_size={page_size}, num_splits={splits}"
    ref = kv_reference(q, k, v, [1000, 1, 400], True)[0]
    assert rel_error(reference.to_numpy64(paged), ref) < BOUND["bfloat16"]
    # 40 query tokens: the FA2 kernel over the cache view, a block in one page or row by row
    q40 = torch.randn(b, 40, hq, d, generator=gen).to("cuda", torch.bfloat16)
    dense = cupyflash.attention_with_kvcache(q40, k, v, cache_seqlens=seqlens, causal=True)
    paged, lse = cupyflash.attention_with_kvcache(
        q40, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, causal=True, return_lse=True
    )
    assert torch.equal(dense, paged), f"page_size={page_size}, 40 queries"
    check_kvcache(paged, lse, q40, k, v, [1000, 1, 400], True, "bfloat16")


def test_append_writes_the_cache_in_place(rng):
    torch = need_torch()
    b, length, hkv, d = 3, 64, 2, 64
    k, v = (torch.randn(b, length, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    k0, v0 = k.clone(), v.clone()
    k_new, v_new = (torch.randn(b, 4, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    q = torch.randn(b, 4, 4, d, device="cuda", dtype=torch.float16)
    cached = [0, 17, 60]
    cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=torch.tensor(cached, dtype=torch.int32, device="cuda"),
                                     k_new=k_new, v_new=v_new)  # fmt: skip
    for i, n in enumerate(cached):
        k0[i, n : n + 4], v0[i, n : n + 4] = k_new[i], v_new[i]
    assert torch.equal(k, k0) and torch.equal(v, v0), "exactly the new rows are written, nothing else"
    # paged, page size 1 (every row through the block table)
    pages = torch.zeros(b * length + 5, 1, hkv, d, device="cuda", dtype=torch.float16)
    table = torch.randperm(b * length + 5, device="cuda")[: b * length].reshape(b, length).to(torch.int32)
    cupyflash.attention_with_kvcache(q, pages, pages.clone(), cache_seqlens=torch.tensor(cached, dtype=torch.int32,
                                     device="cuda"), block_table=table, k_new=k_new, v_new=v_new)  # fmt: skip
    for i, n in enumerate(cached):
        for t in range(4):
            assert torch.equal(pages[table[i, n + t], 0], k_new[i, t])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_split_counts(rng, dtype):
    """num_splits = 1 (one pass, no combine), automatic and an odd count agree with the reference."""
    torch = need_torch()
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=tdtype)
    k, v = (torch.randn(2, 5000, 8, 128, device="cuda", dtype=tdtype) for _ in range(2))
    seqlens = torch.tensor([4999, 2048], dtype=torch.int32, device="cuda")
    for splits in (1, 0, 7, 128):
        out, lse = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=splits, return_lse=True)
        check_kvcache(out, lse, q, k, v, [4999, 2048], True, dtype)


def test_int_seqlens_and_cupy_arrays(rng):
    import cupy

    q = cupy.asarray(rng.standard_normal((2, 1, 4, 64))).astype(cupy.float16)
    k, v = (cupy.asarray(rng.standard_normal((2, 300, 2, 64))).astype(cupy.float16) for _ in range(2))
    out, lse = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=250, return_lse=True)
    assert isinstance(out, cupy.ndarray)
    check_kvcache(out, lse, q, k, v, [250, 250], True, "float16")


@pytest.mark.parametrize("nq", [1, 20], ids=["decode", "fa2"])
def test_bad_device_values_without_append_give_nan_rows(nq):
    """Values the host never reads, on the read-only path (no k_new): a length beyond the cache
    or below 0, a page id outside the cache in a page the sequence uses; that sequence's rows
    are NaN (O and LSE), not a plausible answer from clamped reads, and the others are right.
    (The append path: tests/test_gpu_reliability.py.)"""
    torch = need_torch()
    q = torch.randn(3, nq, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(3, 100, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([1000, -5, 60], dtype=torch.int32, device="cuda")
    out, lse = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, return_lse=True)
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert np.isnan(out64[:2]).all() and np.isnan(lse64[:2]).all()
    assert rel_error(out64[2:], kv_reference(q[2:], k[2:], v[2:], [60], True)[0]) < BOUND["float16"]
    with pytest.raises(cupyflash.DeviceValueError, match="cache_seqlens value was outside"):
        cupyflash.check_device_errors()
    cupyflash.check_device_errors()  # read and cleared
    pages = torch.randn(6, 16, 2, 64, device="cuda", dtype=torch.float16)
    table = torch.tensor([[0, 1, 99], [2, 3, -7], [4, 5, 0]], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([48, 48, 32], dtype=torch.int32, device="cuda")  # the third uses pages 4, 5 only
    out, lse = cupyflash.attention_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table,
                                                return_lse=True)  # fmt: skip
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert np.isnan(out64[:2]).all() and np.isnan(lse64[:2]).all()
    third = pages[4:6].reshape(1, 32, 2, 64)
    assert rel_error(out64[2:], kv_reference(q[2:], third, third, [32], True)[0]) < BOUND["float16"]
    with pytest.raises(cupyflash.DeviceValueError, match="block_table entry in use was outside"):
        cupyflash.check_device_errors()
    good = torch.tensor([[0, 1, 2], [3, 4, 5], [4, 5, 0]], dtype=torch.int32, device="cuda")
    cupyflash.attention_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=good)
    cupyflash.check_device_errors()  # a good call sets nothing


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("nq", [1, 4, 33])
@pytest.mark.parametrize("splits", [1, 0])
def test_cache_batch_idx_and_leftpad(rng, head_dim, nq, splits):
    """flash-attn's cache_batch_idx (sequence b reads and appends to cache entry idx[b]) and
    cache_leftpad (its keys start at leftpad[b]): against the float64 reference over exactly
    those keys, the appends in the right entries, the entries no sequence names untouched."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    entries_n, length, hq, hkv = 6, 1031, 8, 2
    entries, first_keys, cached = [5, 0, 3], [0, 17, 600], [1, 500, min(1000, length - nq)]
    b = len(entries)
    q = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(entries_n, length, hkv, head_dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(b, nq, hkv, head_dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    expected_k, expected_v = k.clone(), v.clone()
    for i, entry in enumerate(entries):
        expected_k[entry, cached[i] : cached[i] + nq] = k_new[i]
        expected_v[entry, cached[i] : cached[i] + nq] = v_new[i]
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    out, lse = cupyflash.attention_with_kvcache(
        q, k, v, cache_seqlens=ints(cached), k_new=k_new, v_new=v_new, cache_batch_idx=ints(entries),
        cache_leftpad=ints(first_keys), num_splits=splits, return_lse=True,
    )  # fmt: skip
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    # sequence b sees its entry from its first key on: [B, length - min first key, Hkv, d] caches
    # holding exactly those keys first (zeros after them), for the reference
    width = length - min(first_keys)
    shifted = [
        torch.stack(
            [
                torch.nn.functional.pad(c[e, f:], (0, 0, 0, 0, 0, f - min(first_keys)))
                for e, f in zip(entries, first_keys)
            ]
        )  # fmt: skip
        for c in (k, v)
    ]
    assert shifted[0].shape[1] == width
    lengths = [n + nq - f for n, f in zip(cached, first_keys)]
    check_kvcache(out, lse, q, shifted[0], shifted[1], lengths, True, "bfloat16")
    cupyflash.check_device_errors()  # nothing out of range


@pytest.mark.parametrize(
    "options", [{"window": (100, -1)}, {"softcap": 5.0}, {"window": (300, -1), "softcap": 3.0}], ids=str
)
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("nq", [1, 5, 70])
def test_decode_window_and_softcap(rng, options, page_size, nq):
    """A sliding window (the key blocks before it skipped) and softcap in the decode kernel, on
    ragged caches with an append, contiguous and paged, against the float64 reference."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 3, 1031, 8, 2, 128
    q = torch.randn(b, nq, hq, d, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(b, length, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(b, nq, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    cached = [3, 500, length - nq]
    expected = [k.clone(), v.clone()]
    for i, n in enumerate(cached):
        expected[0][i, n : n + nq], expected[1][i, n : n + nq] = k_new[i], v_new[i]
    k_cache, v_cache, table = k, v, None
    if page_size:
        (k_cache, v_cache), table = _paginate(torch, (k, v), page_size, gen)
    seqlens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new, return_lse=True,
        **options,
    )  # fmt: skip
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert not np.isnan(out64).any() and not np.isnan(lse64).any()
    for i, n in enumerate(cached):
        keys = [x[i : i + 1, : n + nq] for x in expected]
        ref, ref_lse = reference.attention(q[i : i + 1], *keys, causal=True, return_lse=True, **options)
        assert rel_error(out64[i : i + 1], ref) < BOUND["bfloat16"], i
        np.testing.assert_allclose(lse64[i : i + 1], ref_lse, atol=2e-2)


@pytest.mark.parametrize("nq", [1, 20], ids=["decode", "fa2"])
def test_bad_batch_idx_and_leftpad_give_nan_rows_and_append_nothing(nq):
    """A cache_batch_idx outside the cache's entries, a cache_leftpad past cache_seqlens: that
    sequence's rows are NaN, nothing is appended for it, the others are right, and
    check_device_errors names the value."""
    torch = need_torch()
    q = torch.randn(3, nq, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, 100, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    new = torch.ones(3, nq, 2, 64, device="cuda", dtype=torch.float16)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    for idx, pad, message in (([7, 1, 2], [0, 0, 0], "cache_batch_idx value"), ([0, 1, 2], [50, 0, 0], "leftpad")):
        k0, v0 = k.clone(), v.clone()
        out, lse = cupyflash.attention_with_kvcache(
            q, k, v, cache_seqlens=ints([40, 60, 10]), k_new=new, v_new=new, cache_batch_idx=ints(idx),
            cache_leftpad=ints(pad), return_lse=True,
        )  # fmt: skip
        out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
        assert np.isnan(out64[0]).all() and np.isnan(lse64[0]).all() and not np.isnan(out64[1:]).any()
        assert all(torch.equal(c[e], c0[e]) for c, c0 in ((k, k0), (v, v0)) for e in (0, 3))  # none for sequence 0
        assert torch.equal(k[1, 60], new[1, 0]) and torch.equal(v[2, 10], new[2, 0])  # the others appended
        with pytest.raises(cupyflash.DeviceValueError, match=message):
            cupyflash.check_device_errors()


@pytest.mark.parametrize("nq", [1, 20], ids=["decode", "fa2"])
def test_an_entry_two_appending_sequences_name_is_refused_on_the_device(nq):
    """cache_batch_idx naming one entry for two sequences that both append (k_new): neither
    appends, both get NaN rows, the third is right, and check_device_errors names the value;
    without k_new two sequences read one entry as they should."""
    torch = need_torch()
    q = torch.randn(3, nq, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, 100, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    new = torch.ones(3, nq, 2, 64, device="cuda", dtype=torch.float16)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    k0, v0 = k.clone(), v.clone()
    seqlens = ints([40, 60, 10])
    out, lse = cupyflash.attention_with_kvcache(
        q, k, v, cache_seqlens=seqlens, k_new=new, v_new=new, cache_batch_idx=ints([2, 1, 2]), return_lse=True
    )
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert np.isnan(out64[[0, 2]]).all() and np.isnan(lse64[[0, 2]]).all() and not np.isnan(out64[1]).any()
    assert all(torch.equal(c[e], c0[e]) for c, c0 in ((k, k0), (v, v0)) for e in (0, 2, 3))  # entry 2 untouched
    assert torch.equal(k[1, 60], new[1, 0]) and torch.equal(v[1, 60 + nq - 1], new[1, nq - 1])
    want = reference.attention(q[1:2], k[1:2, : 60 + nq], v[1:2, : 60 + nq], causal=True)
    assert rel_error(out64[1:2], want) < BOUND["float16"]
    with pytest.raises(cupyflash.DeviceValueError, match="another sequence also names"):
        cupyflash.check_device_errors()
    shared = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_batch_idx=ints([2, 1, 2]))
    cupyflash.check_device_errors()  # reading one entry twice is fine
    for i in (0, 2):
        want = reference.attention(q[i : i + 1], k[2:3, : int(seqlens[i])], v[2:3, : int(seqlens[i])], causal=True)
        assert rel_error(reference.to_numpy64(shared[i : i + 1]), want) < BOUND["float16"], i


def test_cuda_graph_capture_replays():
    """A decode step (append, then the split kernel with its fused combine) captured in a CUDA
    graph replays with new inputs written into the same buffers and matches the eager call
    (the graph's tickets and partials are its own buffer, zeroed by a captured memset)."""
    torch = need_torch()
    b, length, hq, hkv, d = 2, 4096, 32, 8, 128
    k, v = (torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([1000, 3000], dtype=torch.int32, device="cuda")
    step = lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, k_new=k_new, v_new=v_new)  # noqa: E731
    graph, graph_out = capture(torch, step)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        seqlens += 1
        graph.replay()
        k_eager, v_eager = k.clone(), v.clone()
        eager = cupyflash.attention_with_kvcache(q, k_eager, v_eager, cache_seqlens=seqlens, k_new=k_new, v_new=v_new)
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager)
        assert torch.equal(k[0, int(seqlens[0])], k_new[0, 0])


def test_split_tickets_per_stream_and_left_at_zero():
    """The fused combine's tickets: concurrent calls on three streams (each with its own buffer)
    give the same bits as the first call on the same inputs every time, the first matches the
    float64 reference, and every stream's counters read 0 afterwards."""
    torch = need_torch()
    from cupyflash import _workspace

    b, length, hq, hkv, d = 3, 6000, 32, 8, 128
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = []
    for _ in streams:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.tensor([5999, 17, 3000], dtype=torch.int32, device="cuda")
        inputs.append((q, k, v, seqlens))
    expected = [cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=s, num_splits=16) for q, k, v, s in inputs]
    torch.cuda.synchronize()
    outs = [[] for _ in streams]
    for _ in range(5):
        for i, stream in enumerate(streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                q, k, v, s = inputs[i]
                outs[i].append(cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=s, num_splits=16))
    torch.cuda.synchronize()
    for want, got in zip(expected, outs, strict=True):
        for out in got:
            assert torch.equal(out, want)
    q, k, v, s = inputs[0]
    out, lse = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=s, num_splits=16, return_lse=True)
    check_kvcache(out, lse, q, k, v, [5999, 17, 3000], True, "bfloat16")
    torch_buffers = {key[2]: buffer for key, buffer in _workspace._buffers.items() if key[0] == "torch"}
    assert {s.cuda_stream for s in streams} <= set(torch_buffers)  # each stream had a buffer
    for buffer in torch_buffers.values():
        counters = buffer.array[: buffer.counter_bytes // 4].view(torch.int32)
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_states_gpu(rng, dtype):
    torch = need_torch()
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 7, 4, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    a = cupyflash.attention(q, k[:, :100], v[:, :100], return_lse=True)
    b = cupyflash.attention(q, k[:, 100:], v[:, 100:], return_lse=True)
    out, lse = cupyflash.merge_states(a[0].to(tdtype), a[1], b[0].to(tdtype), b[1])
    assert out.dtype == tdtype and lse.dtype == torch.float32
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert rel_error(reference.to_numpy64(out), ref) < BOUND["bfloat16"]
    np.testing.assert_allclose(reference.to_numpy64(lse), ref_lse, atol=2e-3)
    empty = torch.full_like(a[1], -math.inf)
    out, lse = cupyflash.merge_states(a[0], empty, torch.full_like(a[0], math.nan), empty)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_gpu_bad_input_leaves_the_cache_untouched():
    torch = need_torch()
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 32, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    new = torch.ones(2, 1, 2, 64, device="cuda", dtype=torch.float16)
    k0 = k.clone()
    cases = [
        ({"cache_seqlens": 32}, ValueError, "goes beyond the cache"),
        ({"cache_seqlens": torch.tensor([1, 2], device="cuda")}, TypeError, "cache_seqlens must be int32"),
        (
            {"cache_seqlens": 3, "k_new": new.bfloat16(), "v_new": new.bfloat16()},
            TypeError,
            "k_new must have q's dtype",
        ),
    ]
    for kwargs, error, message in cases:
        kw = {"k_new": new, "v_new": new, **kwargs}
        with pytest.raises(error, match=message):
            cupyflash.attention_with_kvcache(q, k, v, **kw)
    pages = torch.randn(4, 24, 2, 64, device="cuda", dtype=torch.float16)
    pages0 = pages.clone()
    table = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="page size 24 .* is not supported"):
        cupyflash.attention_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table, k_new=new, v_new=new)
    many = new.expand(2, 17, 2, 64)
    with pytest.raises(ValueError, match="goes beyond the cache"):  # 17 queries: the FA2 path checks the same
        cupyflash.attention_with_kvcache(torch.randn(2, 17, 4, 64, device="cuda", dtype=torch.float16), k, v,
                                         cache_seqlens=16, k_new=many, v_new=many)  # fmt: skip
    wide = torch.randn(2, 32, 2, 264, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim from 1 to 256"):
        cupyflash.attention_with_kvcache(torch.randn(2, 1, 4, 264, device="cuda", dtype=torch.float16), wide, wide,
                                         cache_seqlens=3)  # fmt: skip
    with pytest.raises(ValueError, match="all inputs must be arrays of one library on one device"):
        cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))
    torch.cuda.synchronize()
    assert torch.equal(k, k0) and torch.equal(pages, pages0)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("nq", [1, 4, 33], ids=["decode1", "decode4", "fa2"])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(128, 128), (128, 64), (80, 32)])
def test_rotary_matches_the_host_twin(rng, interleaved, nq, page_size, head_dim, rotary_dim):
    """rotary_cos / rotary_sin on the GPU (k_new rotated by the append, q by its own kernel into a
    temporary) against the same call on float64 host copies of the same bf16 values: the output,
    the LSE and the appended (rotated) keys read back from the cache."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv = 3, 300, 8, 2
    bf16 = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731
    q, k, v = bf16(b, nq, hq, head_dim), bf16(b, length, hkv, head_dim), bf16(b, length, hkv, head_dim)
    k_new, v_new = bf16(b, nq, hkv, head_dim), bf16(b, nq, hkv, head_dim)
    theta = torch.rand(length + 32, rotary_dim // 2, generator=gen) * 6.28  # a row per position of any page count
    cos, sin = theta.cos().bfloat16(), theta.sin().bfloat16()
    cached = [0, 77, length - nq]
    host = [x.double().numpy() for x in (q, k, v, k_new, v_new, cos, sin)]
    want, want_lse = cupyflash.attention_with_kvcache(
        host[0], host[1], host[2], cache_seqlens=np.array(cached, np.int32), k_new=host[3], v_new=host[4],
        rotary_cos=host[5], rotary_sin=host[6], rotary_interleaved=interleaved, return_lse=True,
    )  # fmt: skip
    gpu = [x.cuda() for x in (q, k, v, k_new, v_new, cos, sin)]
    k_cache, v_cache, table = gpu[1], gpu[2], None
    if page_size:
        (k_cache, v_cache), table = _paginate(torch, (gpu[1], gpu[2]), page_size, gen)
    out, lse = cupyflash.attention_with_kvcache(
        gpu[0], k_cache, v_cache, cache_seqlens=torch.tensor(cached, dtype=torch.int32, device="cuda"),
        block_table=table, k_new=gpu[3], v_new=gpu[4], rotary_cos=gpu[5], rotary_sin=gpu[6],
        rotary_interleaved=interleaved, return_lse=True,
    )  # fmt: skip
    assert rel_error(reference.to_numpy64(out), want) < BOUND["bfloat16"]
    np.testing.assert_allclose(reference.to_numpy64(lse), want_lse, atol=3e-2)
    for i, n in enumerate(cached):  # the appended rows, rotated (rounded to bf16 once)
        if page_size:
            rows = [k_cache[table[i, (n + t) // page_size], (n + t) % page_size] for t in range(nq)]
            got = torch.stack(rows)
        else:
            got = k_cache[i, n : n + nq]
        np.testing.assert_allclose(reference.to_numpy64(got), host[1][i, n : n + nq], rtol=1e-2, atol=1e-2)
    cupyflash.check_device_errors()


@pytest.mark.parametrize("nq", [1, 4, 33], ids=["decode1", "decode4", "fa2"])
def test_rotary_table_shorter_than_the_cache(rng, nq):
    """A rotary table as long as the positions in use (flash-attn's may be shorter than the
    cache): the sequences inside it match the host twin; one whose causal queries reach past it
    gets NaN rows, nothing appended, and check_device_errors names rotary_cos."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 3, 300, 8, 2, 64
    bf16 = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731
    q, k, v = bf16(b, nq, hq, d), bf16(b, length, hkv, d), bf16(b, length, hkv, d)
    k_new, v_new = bf16(b, 1, hkv, d), bf16(b, 1, hkv, d)
    rows = 200  # the cache holds 300 per sequence
    theta = torch.rand(rows, d // 2, generator=gen) * 6.28
    cos, sin = theta.cos().bfloat16(), theta.sin().bfloat16()
    cached = [0, rows - nq, rows - nq + 1]  # the last one's last query at position rows
    host = [x.double().numpy() for x in (q, k, v, k_new, v_new, cos, sin)]
    want, want_lse = cupyflash.attention_with_kvcache(
        host[0][:2], host[1][:2], host[2][:2], cache_seqlens=np.array(cached[:2], np.int32), k_new=host[3][:2],
        v_new=host[4][:2], rotary_cos=host[5], rotary_sin=host[6], causal=True, return_lse=True,
    )  # fmt: skip
    gpu = [x.cuda() for x in (q, k, v, k_new, v_new, cos, sin)]
    before = gpu[1].clone()
    out, lse = cupyflash.attention_with_kvcache(
        gpu[0], gpu[1], gpu[2], cache_seqlens=torch.tensor(cached, dtype=torch.int32, device="cuda"),
        k_new=gpu[3], v_new=gpu[4], rotary_cos=gpu[5], rotary_sin=gpu[6], causal=True, return_lse=True,
    )  # fmt: skip
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert rel_error(out64[:2], want) < BOUND["bfloat16"]
    np.testing.assert_allclose(lse64[:2], want_lse, atol=3e-2)
    assert np.isnan(out64[2]).all() and np.isnan(lse64[2]).all()
    assert torch.equal(gpu[1][2], before[2])  # nothing appended through the refused sequence
    with pytest.raises(cupyflash.DeviceValueError, match="past rotary_cos's positions"):
        cupyflash.check_device_errors()
