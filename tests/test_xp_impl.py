"""The array-API algorithms (the CPU path) against the float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import reference, xp_impl
from cupyflash._validate import attention_problem

# (B, Nq, Nk, Hq, Hkv, d, causal, window, softcap): odd lengths, Nq != Nk, GQA, MQA, windows,
# softcap, a single query, a single key, and rows that see no key (Nq > Nk with causal).
CASES = [
    (2, 37, 53, 4, 2, 32, True, (-1, -1), 0.0),
    (1, 97, 97, 2, 1, 64, False, (10, 5), 0.0),
    (2, 7, 200, 6, 3, 16, True, (30, -1), 5.0),
    (1, 1, 1025, 2, 2, 8, True, (-1, -1), 0.0),
    (1, 200, 7, 2, 2, 8, True, (-1, -1), 0.0),
    (1, 61, 1, 3, 1, 24, False, (-1, -1), 0.0),
    (3, 33, 65, 4, 4, 16, False, (-1, 0), 30.0),
    (1, 129, 130, 2, 2, 40, False, (0, 0), 0.0),
]


def _inputs(xp, rng, case, dtype):
    b, nq, nk, hq, hkv, d, *_ = case
    arrays = [rng.standard_normal(shape) for shape in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d))]
    return arrays, [xp.asarray(a.astype(dtype)) for a in arrays]


@pytest.mark.parametrize("algorithm", ["naive", "fa1", "fa2", "decode"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}-w{c[7][0]}_{c[7][1]}-s{c[8]}"
)
def test_algorithm_matches_reference(xp, rng, algorithm, case):
    *_, causal, window, softcap = case
    host, (q, k, v) = _inputs(xp, rng, case, np.float32)
    out, lse = cupyflash.attention(
        q, k, v, causal=causal, window=window, softcap=softcap, algorithm=algorithm, return_lse=True
    )
    ref, ref_lse = reference.attention(*host, causal=causal, window=window, softcap=softcap, return_lse=True)
    out_np, lse_np = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert out_np.shape == ref.shape and lse_np.shape == ref_lse.shape
    assert np.isfinite(out_np).all()
    # float32 inputs and arithmetic: errors far under 1e-5 relative
    assert np.linalg.norm(out_np - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-30) + 1e-6
    assert (np.isinf(lse_np) == np.isinf(ref_lse)).all()
    finite = np.isfinite(ref_lse)
    assert np.allclose(lse_np[finite], ref_lse[finite], atol=1e-4)


def test_blocks_are_real(rng):
    """FA1 and FA2 run many blocks on a long sequence (no whole-matrix shortcut) and agree."""
    case = (1, 300, 333, 2, 1, 16, True, (-1, -1), 0.0)
    host, (q, k, v) = _inputs(np, rng, case, np.float64)
    p = attention_problem(
        q.shape, k.shape, v.shape, causal=True, scale=None, window=(-1, -1), softcap=0.0, layout="bshd"
    )
    assert xp_impl.fa1_block_sizes(16, sram_elements=1024) == (16, 16)
    ref = reference.attention(*host, causal=True)
    for algorithm, options in (
        ("fa1", {"sram_elements": 1024}),
        ("fa2", {"block_m": 32, "block_n": 16}),
        ("decode", {"num_splits": 7}),
    ):
        out, _ = xp_impl.attention(np, q, k, v, p, algorithm=algorithm, **options)
        np.testing.assert_allclose(out, ref, atol=1e-12)


def test_fa1_tile_rule():
    """B_c = ceil(M / 4d), B_r = min(B_c, d)."""
    assert xp_impl.fa1_block_sizes(64, sram_elements=100_000) == (64, 391)
    assert xp_impl.fa1_block_sizes(512, sram_elements=100_000) == (49, 49)


def test_decode_split_counts_agree(rng):
    host, (q, k, v) = _inputs(np, rng, (2, 3, 777, 8, 2, 32, True, (-1, -1), 0.0), np.float64)
    p = attention_problem(
        q.shape, k.shape, v.shape, causal=True, scale=None, window=(-1, -1), softcap=0.0, layout="bshd"
    )
    outs = [xp_impl.attention(np, q, k, v, p, algorithm="decode", num_splits=s)[0] for s in (1, 2, 5, 13, 100)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], atol=1e-12)


def test_bhsd_layout_and_scale(xp, rng):
    host = [rng.standard_normal((2, 3, 19, 16)) for _ in range(3)]
    q, k, v = (xp.asarray(a.astype(np.float32)) for a in host)
    for scale in (0.37, -1.5, 0.0):
        out = cupyflash.attention(q, k, v, layout="bhsd", scale=scale, causal=True)
        ref = reference.attention(*host, layout="bhsd", scale=scale, causal=True)
        np.testing.assert_allclose(reference.to_numpy64(out), ref, atol=2e-5)


def test_empty_sequences(xp):
    q = xp.ones((2, 0, 4, 8))
    k = xp.ones((2, 5, 2, 8))
    out, lse = cupyflash.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)
    q = xp.ones((1, 3, 2, 8))
    k = xp.ones((1, 0, 2, 8))
    out, lse = cupyflash.attention(q, k, k, return_lse=True)
    assert float(xp.max(xp.abs(out))) == 0.0
    assert all(math.isinf(float(x)) and float(x) < 0 for x in reference.to_numpy64(lse).ravel())


def test_float64_stays_float64(rng):
    host = [rng.standard_normal((1, 9, 2, 8)) for _ in range(3)]
    out = cupyflash.attention(*host, causal=True)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, reference.attention(*host, causal=True), atol=1e-13)


def test_merge_verb_is_exact(rng):
    """Merging the partials of two disjoint key sets equals attention over their union."""
    host = [rng.standard_normal((1, 5, 2, 8)) for _ in range(3)]
    full, full_lse = reference.attention(*host, return_lse=True)
    q, k, v = host
    parts = [reference.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 3), slice(3, 5))]
    to5 = lambda o: np.transpose(o, (0, 2, 1, 3))  # noqa: E731
    out, lse = xp_impl.merge(np, [to5(parts[0][0]), to5(parts[1][0])], [parts[0][1], parts[1][1]])
    np.testing.assert_allclose(to5(out), full, atol=1e-12)
    np.testing.assert_allclose(lse, full_lse, atol=1e-12)
    # an empty part weighs nothing; all empty gives 0 and -inf
    empty_lse = np.full_like(full_lse, -np.inf)
    out, lse = xp_impl.merge(np, [to5(full), np.zeros_like(to5(full))], [full_lse, empty_lse])
    np.testing.assert_allclose(to5(out), full, atol=1e-12)
    out, lse = xp_impl.merge(np, [to5(full)], [empty_lse])
    assert (out == 0).all() and np.isneginf(lse).all()
