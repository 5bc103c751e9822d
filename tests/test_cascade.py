"""attention_with_shared_prefix (cascade decoding) on the host: against the flat paged call over
each request's prefix pages followed by its own, with groups, appends, several query tokens,
splits of the prefix (forced: the host path runs one) and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _cascade


def _pool_and_tables(rng, page_size, prefix_lens, own_lens, groups, hkv=2, d=16, spare=2):
    """A shuffled page pool holding each group's prefix and each request's own keys (room for
    ``spare`` more tokens), the two-level tables, and the flat table of the same keys."""
    prefix_pages = [-(-n // page_size) for n in prefix_lens]
    own_pages = [-(-(n + spare) // page_size) for n in own_lens]
    total = sum(prefix_pages) + sum(own_pages)
    order = rng.permutation(total).astype(np.int32)
    pool = rng.standard_normal((total, page_size, hkv, d))
    v_pool = rng.standard_normal((total, page_size, hkv, d))
    taken = iter(order)
    prefix_rows = [[next(taken) for _ in range(n)] for n in prefix_pages]
    own_rows = [[next(taken) for _ in range(n)] for n in own_pages]
    width = max(prefix_pages)
    prefix_table = np.array([r + [0] * (width - len(r)) for r in prefix_rows], dtype=np.int32)
    own_width = max(own_pages)
    own_table = np.array([r + [0] * (own_width - len(r)) for r in own_rows], dtype=np.int32)
    flat = []
    for g in range(len(prefix_lens)):
        for b in range(groups[g], groups[g + 1]):
            # a prefix of whole pages: the flat sequence continues with the request's own pages
            assert prefix_lens[g] % page_size == 0
            flat.append(prefix_rows[g] + own_rows[b])
    flat_width = max(len(r) for r in flat)
    flat_table = np.array([r + [0] * (flat_width - len(r)) for r in flat], dtype=np.int32)
    return pool, v_pool, prefix_table, own_table, flat_table


@pytest.mark.parametrize("splits", [1, 3, 4])
@pytest.mark.parametrize(("nq", "nnew"), [(1, 0), (1, 1), (3, 3)])
def test_matches_the_flat_paged_call(rng, splits, nq, nnew, monkeypatch):
    monkeypatch.setattr(_cascade, "_prefix_splits", lambda *args: splits)
    page_size, groups = 4, [0, 2, 5]
    prefix_lens, own_lens = [24, 12], [3, 0, 7, 1, 5]
    pool, v_pool, prefix_table, own_table, flat_table = _pool_and_tables(rng, page_size, prefix_lens, own_lens, groups)
    b, hq, d = 5, 6, pool.shape[-1]
    q = rng.standard_normal((b, nq, hq, d))
    k_new = v_new = None
    if nnew:
        k_new, v_new = (rng.standard_normal((b, nnew, 2, d)) for _ in range(2))
    seqlens = np.array(own_lens, dtype=np.int32)
    k_flat, v_flat = pool.copy(), v_pool.copy()
    out, lse = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=np.array(prefix_lens, dtype=np.int32),
        block_table=own_table, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, prefix_groups=groups,
        return_lse=True,
    )  # fmt: skip
    per_request = np.repeat(prefix_lens, np.diff(groups)).astype(np.int32)
    want, want_lse = cupyflash.attention_with_kvcache(
        q, k_flat, v_flat, cache_seqlens=seqlens + per_request, block_table=flat_table, k_new=k_new, v_new=v_new,
        return_lse=True,
    )  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    np.testing.assert_array_equal(pool, k_flat)  # the append wrote the same keys into the same pages
    np.testing.assert_array_equal(v_pool, v_flat)


def test_one_group_softcap_non_causal_and_an_empty_prefix(rng):
    page_size = 8
    pool, v_pool, prefix_table, own_table, flat_table = _pool_and_tables(rng, page_size, [16], [5, 9], [0, 2])
    q = rng.standard_normal((2, 2, 2, pool.shape[-1]))
    seqlens = np.array([5, 9], dtype=np.int32)
    options = {"causal": False, "softcap": 3.0, "scale": 0.3}
    out = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=16, block_table=own_table,
        cache_seqlens=seqlens, **options,
    )  # fmt: skip
    want = cupyflash.attention_with_kvcache(q, pool, v_pool, cache_seqlens=seqlens + 16, block_table=flat_table,
                                            **options)  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-12)
    # A prefix of no keys: the suffix alone.
    out = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=0, block_table=own_table,
        cache_seqlens=seqlens, **options,
    )  # fmt: skip
    alone = cupyflash.attention_with_kvcache(q, pool, v_pool, cache_seqlens=seqlens, block_table=own_table, **options)
    np.testing.assert_allclose(out, alone, atol=1e-12)


def test_refusals(rng):
    pool, v_pool, prefix_table, own_table, _ = _pool_and_tables(rng, 4, [8, 8], [2, 2, 2], [0, 1, 3])
    q = rng.standard_normal((3, 3, 2, pool.shape[-1]))
    args = {"prefix_block_table": prefix_table, "prefix_seqlens": 8, "block_table": own_table}
    with pytest.raises(ValueError, match="prefix_groups is needed"):
        cupyflash.attention_with_shared_prefix(q[:, :1], pool, v_pool, cache_seqlens=2, **args)
    with pytest.raises(ValueError, match="offsets from 0 to B"):
        cupyflash.attention_with_shared_prefix(q[:, :1], pool, v_pool, cache_seqlens=2, prefix_groups=[0, 3], **args)
    with pytest.raises(ValueError, match="must not decrease"):
        cupyflash.attention_with_shared_prefix(q[:, :1], pool, v_pool, cache_seqlens=2, prefix_groups=[0, 4, 3], **args)
    # Three causal query tokens over two keys of its own: the first query may not see the prefix's end.
    with pytest.raises(ValueError, match="fewer than Nq - 1"):
        cupyflash.attention_with_shared_prefix(
            q, pool, v_pool, cache_seqlens=np.array([2, 2, 1], dtype=np.int32), prefix_groups=[0, 1, 3], **args
        )
    with pytest.raises(ValueError, match="must be paged"):
        cupyflash.attention_with_shared_prefix(q, pool[0], v_pool[0], cache_seqlens=2, prefix_groups=[0, 1, 3], **args)


@pytest.mark.parametrize(("nq", "packed"), [(1, True), (1, False), (3, False)])
def test_the_gpu_merge_layout_reads_the_varlen_output_as_the_host_merge_does(rng, nq, packed):
    """The strides the GPU's one merge launch reads the prefix's S states with (parts_layout),
    walked in NumPy as kernels_cu/decode.cu's decode_merge walks them, against the host's pairwise
    merge of the same varlen output."""
    b, hq, hkv, d, splits = 3, 8, 2, 32, 4
    heads, per = (hkv, hq // hkv) if packed else (hq, 1)
    rows = b * nq * per
    out_p = rng.standard_normal((splits * rows, heads, d))
    lse_p = rng.standard_normal((heads, splits * rows))
    lse_p[:, 5] = -np.inf  # a row of a part that saw no key
    want, want_lse = _cascade._merge_prefix(np, out_p, lse_p, splits, (b, nq, hq, hkv, d), packed)
    layout = _cascade.parts_layout(splits, (b, nq, hq, hkv, d), packed)
    o_flat, lse_flat = out_p.reshape(-1), lse_p.reshape(-1)
    out, lse = np.zeros(int(np.prod(layout.out_shape))), np.zeros(int(np.prod(layout.lse_shape)))
    (nb, nr, nh, _), (op, ob, orow, oh), (lp, lb, lh) = layout.dims, layout.o_strides, layout.lse_strides
    for i_b in range(nb):
        for i_r in range(nr):
            for i_h in range(nh):
                parts_lse = np.array([lse_flat[p * lp + i_b * lb + i_h * lh + i_r] for p in range(splits)])
                base = i_b * ob + i_r * orow + i_h * oh
                parts = np.stack([o_flat[p * op + base : p * op + base + d] for p in range(splits)])
                total = np.logaddexp.reduce(parts_lse)
                o = (np.exp(parts_lse - total)[:, None] * parts).sum(0)
                s_b, s_r, s_h = layout.out_strides
                start = i_b * s_b + i_r * s_r + i_h * s_h
                out[start : start + d] = o
                lse[i_b * layout.out_lse_strides[0] + i_h * layout.out_lse_strides[1] + i_r] = total
    np.testing.assert_allclose(out.reshape(layout.out_shape), want, atol=1e-12)
    np.testing.assert_allclose(lse.reshape(layout.lse_shape), want_lse, atol=1e-12)


def test_prefix_lengths_past_the_prefix_table_raise_before_the_append(rng):
    pool, v_pool, prefix_table, own_table, _ = _pool_and_tables(rng, 4, [8], [2, 2], [0, 2])
    q = rng.standard_normal((2, 1, 2, pool.shape[-1]))
    k_new = v_new = rng.standard_normal((2, 1, 2, pool.shape[-1]))
    before = pool.copy()
    for lens in (9, -1, np.array([12], dtype=np.int32)):  # the table's 2 pages hold 8 keys
        with pytest.raises(ValueError, match=r"prefix_seqlens .* outside \[0, 8\]"):
            cupyflash.attention_with_shared_prefix(
                q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=lens, block_table=own_table,
                cache_seqlens=2, k_new=k_new, v_new=v_new,
            )  # fmt: skip
    np.testing.assert_array_equal(pool, before)
