"""attention_with_kvcache and merge_states on host arrays (the array-API twin of the decode
kernels) against the float64 reference, and their input checks."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import kv_reference, paginate

import cupyflash
from cupyflash import reference
from cupyflash._dispatch import decode_num_splits, split_blocks


@pytest.mark.parametrize("page_size", [None, 1, 4, 16])
@pytest.mark.parametrize(("nq", "causal"), [(1, True), (3, True), (5, False)])
def test_kvcache_matches_reference(xp, rng, page_size, nq, causal):
    b, length, hq, hkv, d, nnew = 4, 37, 6, 2, 16, 2
    q = rng.standard_normal((b, nq, hq, d))
    k_cache, v_cache = (rng.standard_normal((b, length, hkv, d)) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, nnew, hkv, d)) for _ in range(2))
    cached = np.array([0, 1, 20, length - nnew], dtype=np.int32)  # ragged, with 0 and 1
    table = None
    k_dev, v_dev = k_cache, v_cache
    if page_size is not None:
        (k_dev, v_dev), table = paginate(rng, (k_cache, v_cache), page_size)
    args = [xp.asarray(x.astype(np.float32)) for x in (q, k_dev, v_dev, k_new, v_new)]
    out, lse = cupyflash.attention_with_kvcache(
        args[0], args[1], args[2], cache_seqlens=xp.asarray(cached), k_new=args[3], v_new=args[4],
        block_table=None if table is None else xp.asarray(table), causal=causal, return_lse=True,
    )  # fmt: skip
    # the new tokens were written into the caller's cache, at cache_seqlens[b] + t
    k_after = reference.to_numpy64(args[1])
    for i in range(b):
        for t in range(nnew):
            pos = int(cached[i]) + t
            where = (i, pos) if table is None else (table[i, pos // page_size], pos % page_size)
            np.testing.assert_array_equal(k_after[where], k_new[i, t].astype(np.float32))
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    ref_k, ref_v = f32(k_cache), f32(v_cache)
    for i in range(b):
        ref_k[i, cached[i] : cached[i] + nnew] = f32(k_new[i])
        ref_v[i, cached[i] : cached[i] + nnew] = f32(v_new[i])
    ref, ref_lse = kv_reference(f32(q), ref_k, ref_v, cached + nnew, causal)
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    np.testing.assert_allclose(out64, ref, atol=2e-5)
    assert (np.isneginf(lse64) == np.isneginf(ref_lse)).all()
    np.testing.assert_allclose(lse64[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-4)


def kv_entries_reference(q, caches, entries, first_keys, ends, causal):
    """float64 attention of sequence b over keys first_keys[b] .. ends[b] - 1 of cache entry
    entries[b]: (out, LSE)."""
    outs, lses = [], []
    for b, (entry, first, end) in enumerate(zip(entries, first_keys, ends)):
        k, v = (c[entry : entry + 1, first:end] for c in caches)
        out, lse = reference.attention(q[b : b + 1], k, v, causal=causal, return_lse=True)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("options", ["batch_idx", "leftpad", "both"])
def test_kvcache_batch_idx_and_leftpad_match_reference(xp, rng, options):
    """flash-attn's cache_batch_idx (sequence b in cache entry idx[b]) and cache_leftpad (its keys
    from leftpad[b]): appends at cache_seqlens[b] of the entry, attention over [leftpad, end)."""
    entries_n, b, length, hq, hkv, d, nnew = 5, 3, 40, 4, 2, 16, 2
    use_idx, use_pad = options in ("batch_idx", "both"), options in ("leftpad", "both")
    entries = [4, 0, 2] if use_idx else [0, 1, 2]
    first_keys = [0, 3, 7] if use_pad else [0, 0, 0]
    cached = [5, 10, 20]
    q = rng.standard_normal((b, 2, hq, d)).astype(np.float32)
    caches = [rng.standard_normal((entries_n if use_idx else b, length, hkv, d)).astype(np.float32) for _ in "kv"]
    new = [rng.standard_normal((b, nnew, hkv, d)).astype(np.float32) for _ in "kv"]
    expected = [c.copy() for c in caches]
    for i, entry in enumerate(entries):
        for c, n in zip(expected, new):
            c[entry, cached[i] : cached[i] + nnew] = n[i]
    args = [xp.asarray(x) for x in (q, *caches, *new)]
    out, lse = cupyflash.attention_with_kvcache(
        args[0], args[1], args[2], cache_seqlens=xp.asarray(np.array(cached, np.int32)), k_new=args[3],
        v_new=args[4], cache_batch_idx=xp.asarray(np.array(entries, np.int32)) if use_idx else None,
        cache_leftpad=xp.asarray(np.array(first_keys, np.int32)) if use_pad else None, return_lse=True,
    )  # fmt: skip
    for got, want in zip(args[1:3], expected):  # appended into the entries, the others untouched
        np.testing.assert_array_equal(reference.to_numpy64(got), want.astype(np.float64))
    ends = [n + nnew for n in cached]
    ref, ref_lse = kv_entries_reference(q, expected, entries, first_keys, ends, True)
    np.testing.assert_allclose(reference.to_numpy64(out), ref, atol=2e-5)
    np.testing.assert_allclose(reference.to_numpy64(lse), ref_lse, atol=1e-4)


@pytest.mark.parametrize(
    "options",
    [{"window": (6, -1)}, {"softcap": 2.5}, {"window": (4, 2), "causal": False}, {"window": (9, -1), "softcap": 4.0}],
    ids=str,
)
@pytest.mark.parametrize("page_size", [None, 4])
def test_kvcache_window_and_softcap_match_reference(xp, rng, options, page_size):
    """window and softcap on attention_with_kvcache, as attention's over each sequence's keys."""
    b, length, hq, hkv, d, nnew, nq = 3, 40, 4, 2, 16, 2, 3
    q = rng.standard_normal((b, nq, hq, d)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((b, length, hkv, d)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, nnew, hkv, d)).astype(np.float32) for _ in range(2))
    cached = np.array([1, 17, 30], dtype=np.int32)
    ref_k, ref_v = k_cache.copy(), v_cache.copy()
    for i in range(b):
        ref_k[i, cached[i] : cached[i] + nnew], ref_v[i, cached[i] : cached[i] + nnew] = k_new[i], v_new[i]
    table, k_dev, v_dev = None, k_cache, v_cache
    if page_size is not None:
        (k_dev, v_dev), table = paginate(rng, (k_cache, v_cache), page_size)
    args = [xp.asarray(x) for x in (q, k_dev, v_dev, k_new, v_new)]
    out, lse = cupyflash.attention_with_kvcache(
        args[0], args[1], args[2], cache_seqlens=xp.asarray(cached), k_new=args[3], v_new=args[4],
        block_table=None if table is None else xp.asarray(table), return_lse=True, **options,
    )  # fmt: skip
    opts = {"causal": True, **options}
    for i in range(b):
        n = int(cached[i]) + nnew
        ref, ref_lse = reference.attention(q[i : i + 1], ref_k[i : i + 1, :n], ref_v[i : i + 1, :n], return_lse=True,
                                           **opts)  # fmt: skip
        np.testing.assert_allclose(reference.to_numpy64(out)[i : i + 1], ref, atol=2e-5)
        got_lse = reference.to_numpy64(lse)[i : i + 1]
        assert (np.isneginf(got_lse) == np.isneginf(ref_lse)).all()
        np.testing.assert_allclose(got_lse[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-4)


def test_kvcache_empty_batch():
    q, cache = np.zeros((0, 1, 4, 8), np.float32), np.zeros((0, 10, 2, 8), np.float32)
    out, lse = cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=3, return_lse=True)
    assert out.shape == (0, 1, 4, 8) and lse.shape == (0, 4, 1)


def test_kvcache_empty_and_single_key_sequences(rng):
    q = rng.standard_normal((3, 2, 4, 8))
    k, v = (rng.standard_normal((3, 10, 2, 8)) for _ in range(2))
    out, lse = cupyflash.attention_with_kvcache(
        q, k, v, cache_seqlens=np.array([0, 1, 10], dtype=np.int32), causal=True, return_lse=True
    )
    ref, ref_lse = kv_reference(q, k, v, [0, 1, 10], True)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    assert np.isneginf(lse[0]).all() and (out[0] == 0).all()
    np.testing.assert_allclose(lse[2], ref_lse[2], atol=1e-12)


def test_split_counts_agree_with_one_split(rng):
    """The split-KV path is exact: any number of splits gives the single-pass answer."""
    q = rng.standard_normal((2, 3, 8, 16))
    k, v = (rng.standard_normal((2, 700, 2, 16)) for _ in range(2))
    seqlens = np.array([699, 333], dtype=np.int32)
    results = [cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=s) for s in (1, 2, 3, 11)]
    for out in results[1:]:
        np.testing.assert_allclose(out, results[0], atol=1e-12)
    np.testing.assert_allclose(results[0], kv_reference(q, k, v, [699, 333], True)[0], atol=1e-12)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_nan_reaches_only_the_sequence_and_rows_that_see_it(rng, paged):
    """NaN past a sequence's length (stale cache rows, spare pages) is never read; a NaN value
    inside it gives NaN in the rows that see its key, a NaN key NaN rows and LSE, with any split."""
    b, length, hq, hkv, d, nq = 3, 40, 4, 2, 8, 3
    q = rng.standard_normal((b, nq, hq, d))
    k, v = (rng.standard_normal((b, length, hkv, d)) for _ in range(2))
    lengths = [0, 17, 33]
    for i, n in enumerate(lengths):
        k[i, n:], v[i, n:] = np.nan, np.inf  # past the end: never read
    v[1, 16, 0, 5] = np.nan  # key 16 of 17: seen by sequence 1's last query row only (causal)
    k[2, 3, 1, :] = np.nan  # key 3 of 33: seen by every row of sequence 2, KV head 1
    ref, ref_lse = kv_reference(q, k, v, lengths, True)
    table = None
    k_cache, v_cache = k, v
    if paged:
        (k_cache, v_cache), table = paginate(rng, (k, v), 4)
        k_cache[table.max() + 1 :], v_cache[table.max() + 1 :] = np.nan, np.nan  # spare pages
    for splits in (1, 2, 3, 11):
        out, lse = cupyflash.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=np.array(lengths, np.int32), block_table=table, num_splits=splits,
            return_lse=True,
        )  # fmt: skip
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(ref), atol=1e-12)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert np.isnan(out[1, 2, :2, 5]).all() and not np.isnan(out[1, :2]).any()
    assert np.isnan(lse[2, 2:]).all() and np.isfinite(lse[2, :2]).all()


def test_int_cache_seqlens(rng):
    q = rng.standard_normal((2, 1, 2, 8))
    k, v = (rng.standard_normal((2, 9, 2, 8)) for _ in range(2))
    out = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=5)
    np.testing.assert_allclose(out, kv_reference(q, k, v, [5, 5], True)[0], atol=1e-12)


def test_merge_states_is_exact(xp, rng):
    q = rng.standard_normal((2, 5, 4, 16))
    k, v = (rng.standard_normal((2, 30, 2, 16)) for _ in range(2))
    full, full_lse = reference.attention(q, k, v, return_lse=True)
    a = reference.attention(q, k[:, :11], v[:, :11], return_lse=True)
    b = reference.attention(q, k[:, 11:], v[:, 11:], return_lse=True)
    args = [xp.asarray(x.astype(np.float32)) for x in (a[0], a[1], b[0], b[1])]
    out, lse = cupyflash.merge_states(*args)
    np.testing.assert_allclose(reference.to_numpy64(out), full, atol=1e-5)
    np.testing.assert_allclose(reference.to_numpy64(lse), full_lse, atol=1e-5)
    # an empty state weighs nothing; two empty states give 0 and -inf
    empty_o = xp.asarray(np.full(full.shape, np.nan, dtype=np.float32))
    empty_lse = xp.asarray(np.full(full_lse.shape, -np.inf, dtype=np.float32))
    # (its O may be NaN or garbage, as the GPU kernel's and the docstring's rule)
    out, lse = cupyflash.merge_states(xp.asarray(full.astype(np.float32)), xp.asarray(full_lse.astype(np.float32)),
                                      empty_o, empty_lse)  # fmt: skip
    np.testing.assert_allclose(reference.to_numpy64(out), full, atol=1e-5)
    out, lse = cupyflash.merge_states(empty_o, empty_lse, xp.asarray(full.astype(np.float32)),
                                      xp.asarray(full_lse.astype(np.float32)))  # fmt: skip
    np.testing.assert_allclose(reference.to_numpy64(out), full, atol=1e-5)
    out, lse = cupyflash.merge_states(empty_o, empty_lse, empty_o, empty_lse)
    assert (reference.to_numpy64(out) == 0).all() and np.isneginf(reference.to_numpy64(lse)).all()


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, and the cache untouched.
# ---------------------------------------------------------------------------------------------
B, L, HQ, HKV, D = 2, 8, 4, 2, 8


def _bad_case(**changes):
    rng = np.random.default_rng(1)
    args = {
        "q": rng.standard_normal((B, 1, HQ, D)).astype(np.float32),
        "k_cache": rng.standard_normal((B, L, HKV, D)).astype(np.float32),
        "v_cache": rng.standard_normal((B, L, HKV, D)).astype(np.float32),
        "cache_seqlens": np.array([3, 4], dtype=np.int32),
        "k_new": np.ones((B, 2, HKV, D), dtype=np.float32),
        "v_new": np.ones((B, 2, HKV, D), dtype=np.float32),
    }
    args.update(changes)
    return args


PAGED = {
    "k_cache": np.zeros((6, 4, HKV, D), dtype=np.float32),
    "v_cache": np.zeros((6, 4, HKV, D), dtype=np.float32),
    "block_table": np.array([[0, 1], [2, 3]], dtype=np.int32),
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cache_seqlens": np.array([3, 7], dtype=np.int32)}, r"cache_seqlens\[1\]=7 with 2 new tokens goes beyond"),
        ({"cache_seqlens": np.array([-1, 0], dtype=np.int32)}, r"cache_seqlens\[0\]=-1"),
        ({"cache_seqlens": 7}, "cache_seqlens=7 with 2 new tokens goes beyond the cache"),
        ({"cache_seqlens": np.array([1, 2, 3], dtype=np.int32)}, "1-D int32 array of length 2"),
        ({"cache_seqlens": np.array([1.0, 2.0])}, "cache_seqlens must be an integer array"),
        ({**PAGED, "block_table": np.array([[0, 1], [2, 6]], dtype=np.int32)}, r"block_table\[1\] points outside"),
        ({**PAGED, "block_table": np.array([[0, 1]], dtype=np.int32)}, "block_table must be 2-D"),
        (
            {**PAGED, "k_cache": np.zeros((6, 3, HKV, D), np.float32), "v_cache": np.zeros((6, 3, HKV, D), np.float32)},
            "page size 3 .* is not supported",
        ),  # fmt: skip
        ({"k_new": np.ones((B, 2, HKV, D), dtype=np.float64)}, "k_new must have q's real floating dtype"),
        ({"v_cache": np.zeros((B, L, HKV, D), dtype=np.float16)}, "v_cache must have q's real floating dtype"),
        ({"v_new": None}, "k_new and v_new go together"),
        ({"k_new": np.ones((B, 2, HKV, D + 1), np.float32)}, "k_new and v_new must have the same shape"),
        ({"k_cache": np.zeros((B, L, HKV + 1, D), np.float32)}, "k_cache and v_cache must have the same shape"),
        ({"q": np.zeros((B, 1, 3, D), np.float32)}, "multiple of the number of key/value heads"),
        (
            {"k_cache": np.zeros((3, L, HKV, D), np.float32), "v_cache": np.zeros((3, L, HKV, D), np.float32)},
            "batch size of q",
        ),  # fmt: skip
        ({"num_splits": -1}, "num_splits must be an int >= 0"),
        ({"cache_batch_idx": np.array([0, 2], dtype=np.int32)}, r"cache_batch_idx\[1\]=2 is outside the cache's 2"),
        ({"cache_batch_idx": np.array([0], dtype=np.int32)}, "cache_batch_idx must be a 1-D int32 array of length 2"),
        ({**PAGED, "cache_batch_idx": np.array([0, 1], dtype=np.int32)}, "cache_batch_idx is for contiguous caches"),
        ({"cache_leftpad": np.array([0, 5], dtype=np.int32)}, r"cache_leftpad\[1\]=5 is outside \[0, cache_seqlens"),
        ({"cache_leftpad": np.array([-1, 0], dtype=np.int32)}, r"cache_leftpad\[0\]=-1"),
        ({**PAGED, "cache_leftpad": np.array([0, 1], dtype=np.int32)}, "cache_leftpad is for contiguous caches"),
        ({"cache_leftpad": np.array([0.0, 1.0])}, "cache_leftpad must be an integer array"),
        ({"cache_batch_idx": np.array([1, 1], dtype=np.int32)}, r"names an entry twice, with k_new/v_new"),
    ],
)
def test_bad_input_leaves_the_cache_untouched(changes, message):
    args = _bad_case(**changes)
    before = {name: args[name].copy() for name in ("k_cache", "v_cache")}
    with pytest.raises((ValueError, TypeError), match=message):
        cupyflash.attention_with_kvcache(**args)
    for name, value in before.items():
        np.testing.assert_array_equal(args[name], value)


def test_merge_states_rejects_mismatched_shapes():
    o = np.zeros((1, 3, 2, 8), np.float32)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        cupyflash.merge_states(o, np.zeros((1, 2, 3), np.float32), o, np.zeros((1, 3, 2), np.float32))
    with pytest.raises(ValueError, match="o_a and o_b must have the same shape"):
        cupyflash.merge_states(o, np.zeros((1, 2, 3), np.float32), o[:, :2], np.zeros((1, 2, 3), np.float32))


# ---------------------------------------------------------------------------------------------
# The split heuristic.
# ---------------------------------------------------------------------------------------------
def test_split_heuristic_fills_the_gpu():
    # H200: 132 SMs, 2 CTAs each. One sequence, 8 KV heads, 128k keys in 64-key blocks: a full
    # wave (32 splits x 8 = 256 of 264 slots), not a handful of SMs.
    assert decode_num_splits(ctas=8, key_blocks=2048, num_sms=132, ctas_per_sm=2) == 32
    # 64 sequences x 8 heads = 512 CTAs already fill two waves (97%): no split, no combine.
    assert decode_num_splits(ctas=512, key_blocks=64, num_sms=132, ctas_per_sm=2) == 1
    # ... but with 3 CTAs per SM they would leave a 29% wave: 3 splits fill 4 waves (97%)
    assert decode_num_splits(ctas=512, key_blocks=64, num_sms=132, ctas_per_sm=3) == 3
    # short caches keep at least 4 key blocks per split
    assert decode_num_splits(ctas=8, key_blocks=8, num_sms=132, ctas_per_sm=2) == 2
    assert decode_num_splits(ctas=8, key_blocks=7, num_sms=132, ctas_per_sm=2) == 1


def test_split_blocks_leaves_no_empty_split():
    assert split_blocks(10, 4) == (3, 4)
    assert split_blocks(9, 4) == (3, 3)
    assert split_blocks(5, 100) == (1, 5)
    assert split_blocks(0, 3) == (1, 1)
