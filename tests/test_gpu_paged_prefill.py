"""The FA2 forward over a KV cache on the GPU: packed sequences over a paged cache
(``attention_varlen(..., block_table=)``) and ALiBi on ``attention_with_kvcache``, against the
contiguous kernels (bit for bit where both run one tile) and the float64 reference, with the
device-side values checked. Outputs are NaN-poisoned before every launch (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, need_torch, rel_error

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu


def _packed_pages(torch, gen, lengths, hkv, d, page_size, dtype, spare=3):
    """Packed keys [sum(lengths), Hkv, d] and the same rows in shuffled pages (plus spare pages
    of noise) through a block table [B, max pages per sequence]."""
    per_seq = [-(-n // page_size) for n in lengths]
    width = max(max(per_seq), 1)
    num_pages = sum(per_seq) + spare
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    packed = [torch.randn(sum(lengths), hkv, d, generator=gen).to(dtype) for _ in range(2)]
    pages = [torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    start = 0
    for b, (n, count) in enumerate(zip(lengths, per_seq)):
        for j in range(count):
            page = order.pop()
            table[b, j] = page
            rows = slice(start + j * page_size, start + min((j + 1) * page_size, n))
            for x, p in zip(packed, pages):
                p[page, : rows.stop - rows.start] = x[rows]
        start += n
    return [x.cuda() for x in packed], [p.cuda() for p in pages], table.cuda()


def _cu(torch, lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")


CASES = {
    # (query lengths, key lengths, Hq, Hkv, causal, window): chunked prefill (queries the last of
    # their keys), decode rows (1 query) beside them, an empty sequence, keys past a page edge
    "mixed-causal": ([37, 1, 0, 200, 1], [300, 1029, 0, 200, 17], 8, 2, True, (-1, -1)),
    "mha": ([64, 5], [64, 130], 4, 4, False, (-1, -1)),
    "window": ([100, 3], [700, 900], 8, 1, True, (64, 0)),
}


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_paged_varlen_matches_contiguous_and_reference(rng, page_size, case, head_dim):
    """The same keys packed and in shuffled pages: the same bits from the FA2 kernel (one tile,
    one key order), and the float64 reference per sequence."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q_lens, k_lens, hq, hkv, causal, window = CASES[case]
    (k, v), (k_pages, v_pages), table = _packed_pages(torch, gen, k_lens, hkv, head_dim, page_size, torch.bfloat16)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    cu_q, cu_k = _cu(torch, q_lens), _cu(torch, k_lens)
    options = dict(causal=causal, window=window, return_lse=True)
    dense, dense_lse = cupyflash.attention_varlen(
        q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), algorithm="fa2", **options
    )
    paged, paged_lse = cupyflash.attention_varlen(
        q, k_pages, v_pages, cu_q, cu_k, max(q_lens), max(k_lens), block_table=table, **options
    )
    assert torch.equal(dense, paged) and torch.equal(dense_lse, paged_lse)
    out64 = reference.to_numpy64(paged)
    assert not np.isnan(out64).any()
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        if nq:
            want = reference.attention(
                q[None, q0 : q0 + nq], k[None, k0 : k0 + nk], v[None, k0 : k0 + nk], causal=causal, window=window
            )
            assert rel_error(out64[q0 : q0 + nq], want[0]) < BOUND["bfloat16"]
        q0, k0 = q0 + nq, k0 + nk
    cupyflash.check_device_errors()  # nothing out of range


def test_paged_varlen_seqused_k_and_fp16(rng):
    """seqused_k cuts each sequence's keys (its causal alignment counts those) over pages."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q_lens, k_lens, used = [9, 30], [500, 64], [200, 64]
    (k, v), (k_pages, v_pages), table = _packed_pages(torch, gen, k_lens, 2, 128, 16, torch.float16)
    q = torch.randn(sum(q_lens), 4, 128, generator=gen).to("cuda", torch.float16)
    cu_q, cu_k = _cu(torch, q_lens), _cu(torch, k_lens)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    dense = cupyflash.attention_varlen(q, k, v, *args, causal=True, seqused_k=seqused, algorithm="fa2")
    paged = cupyflash.attention_varlen(q, k_pages, v_pages, *args, causal=True, seqused_k=seqused, block_table=table)
    assert torch.equal(dense, paged)


def test_paged_varlen_bad_device_values_give_nan_rows():
    """A page id in use outside the cache, a key count beyond the sequence's table row: that
    sequence's rows are NaN (O and LSE), the others right, and check_device_errors says so."""
    torch = need_torch()
    q = torch.randn(3 * 20, 4, 64, device="cuda", dtype=torch.float16)
    pages = torch.randn(8, 16, 2, 64, device="cuda", dtype=torch.float16)
    cu_q = torch.tensor([0, 20, 40, 60], dtype=torch.int32, device="cuda")
    ints = lambda rows: torch.tensor(rows, dtype=torch.int32, device="cuda")  # noqa: E731
    for table, k_lens, message in (
        ([[0, 1], [2, 99], [4, 5]], [32, 20, 32], "block_table entry"),  # sequence 1's second page
        ([[0, 1], [2, 3], [4, 5]], [32, 40, 32], "cache_seqlens"),  # 40 keys > 2 pages of 16
    ):
        cu_k = ints(np.concatenate([[0], np.cumsum(k_lens)]).tolist())
        out, lse = cupyflash.attention_varlen(
            q, pages, pages, cu_q, cu_k, 20, 32, causal=True, block_table=ints(table), return_lse=True
        )
        out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
        assert np.isnan(out64[20:40]).all() and np.isnan(lse64[:, 20:40]).all()
        for b, rows in ((0, slice(0, 20)), (2, slice(40, 60))):
            keys = pages[table[b]].reshape(1, 32, 2, 64)
            want = reference.attention(q[None, rows], keys, keys, causal=True)
            assert rel_error(out64[rows], want[0]) < BOUND["float16"]
        with pytest.raises(cupyflash.DeviceValueError, match=message):
            cupyflash.check_device_errors()


@pytest.mark.parametrize("nq", [1, 3, 40])
@pytest.mark.parametrize("slopes_shape", ["head", "batch_head"])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_kvcache_alibi(rng, nq, slopes_shape, page_size, softcap):
    """ALiBi on the cache call (the FA2 kernel over the cache, any query count; after a softcap),
    with an append, against the same call on float64 host copies (the array-API twin)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 3, 600, 8, 2, 64
    q = torch.randn(b, nq, hq, d, generator=gen)
    k, v = (torch.randn(b, length, hkv, d, generator=gen) for _ in range(2))
    k_new, v_new = (torch.randn(b, nq, hkv, d, generator=gen) for _ in range(2))
    slopes = torch.rand(hq if slopes_shape == "head" else (b, hq), generator=gen) * 0.5
    cached = [0, 77, length - nq]
    host = [x.double().numpy() for x in (q, k, v, k_new, v_new)]
    want, want_lse = cupyflash.attention_with_kvcache(
        host[0], host[1], host[2], cache_seqlens=np.array(cached, np.int32), k_new=host[3], v_new=host[4],
        alibi_slopes=slopes.numpy().astype(np.float32), softcap=softcap, return_lse=True,
    )  # fmt: skip
    gpu = [x.to("cuda", torch.bfloat16) for x in (q, k, v, k_new, v_new)]
    k_cache, v_cache, table = gpu[1], gpu[2], None
    if page_size:
        per_seq = length // page_size + 1
        order = torch.randperm(b * per_seq, generator=gen)
        table = order.reshape(b, per_seq).to("cuda", torch.int32)
        pad = torch.nn.functional.pad
        k_cache, v_cache = (
            torch.empty(b * per_seq, page_size, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)
        )
        for src, dst in ((gpu[1], k_cache), (gpu[2], v_cache)):
            dst[order] = pad(src, (0, 0, 0, 0, 0, per_seq * page_size - length)).reshape(-1, page_size, hkv, d)
    out, lse = cupyflash.attention_with_kvcache(
        gpu[0], k_cache, v_cache, cache_seqlens=torch.tensor(cached, dtype=torch.int32, device="cuda"),
        block_table=table, k_new=gpu[3], v_new=gpu[4], alibi_slopes=slopes.cuda(), softcap=softcap, return_lse=True,
    )  # fmt: skip
    assert rel_error(reference.to_numpy64(out), want) < BOUND["bfloat16"]
    np.testing.assert_allclose(reference.to_numpy64(lse), want_lse, atol=2e-2)
