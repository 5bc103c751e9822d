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


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: the same answer from the reference and every algorithm (issue 15).
# ---------------------------------------------------------------------------------------------
HOST_ALGORITHMS = ("naive", "fa1", "fa2", "decode")


def _all_algorithms(q, k, v, **kw):
    """(out, lse) of every host algorithm, FA1 and FA2 with small blocks and decode with several
    split sizes, so that a NaN meets block and split edges."""
    p = attention_problem(
        q.shape, k.shape, v.shape, causal=kw.get("causal", False), scale=None, window=kw.get("window", (-1, -1)),
        softcap=0.0, layout="bshd",
    )  # fmt: skip
    runs = [cupyflash.attention(q, k, v, algorithm=a, return_lse=True, **kw) for a in HOST_ALGORITHMS]
    runs.append(xp_impl.attention(np, q, k, v, p, algorithm="fa1", sram_elements=4 * 8 * 5))
    runs.append(xp_impl.attention(np, q, k, v, p, algorithm="fa2", block_m=3, block_n=4))
    runs += [xp_impl.attention(np, q, k, v, p, algorithm="decode", split_keys=n, block_n=2) for n in (1, 2, 5)]
    return runs


@pytest.mark.parametrize("causal", [False, True])
def test_nan_query_row_gives_nan_output_and_lse(rng, causal):
    q, k, v = (rng.standard_normal(s) for s in ((1, 6, 2, 8), (1, 9, 1, 8), (1, 9, 1, 8)))
    q[0, 2, 1, 5] = np.nan
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert np.isnan(ref[0, 2, 1]).all() and np.isnan(ref_lse[0, 1, 2])
    assert np.isfinite(np.delete(ref_lse[0, 1], 2)).all() and np.isfinite(ref_lse[0, 0]).all()
    for out, lse in _all_algorithms(q, k, v, causal=causal):
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(ref), atol=1e-12)


@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_key_or_value_reaches_exactly_the_rows_that_see_it(rng, where):
    """Causal with Nq = 6, Nk = 9: key 8 is seen by the last query row only. A NaN in its key
    gives that row NaN (O and LSE); a NaN in its value gives NaN in that row's column only.
    Masked copies of the key in the same block or split must not spread it (0 * NaN)."""
    q, k, v = (rng.standard_normal(s) for s in ((1, 6, 2, 8), (1, 9, 1, 8), (1, 9, 1, 8)))
    (k if where == "k" else v)[0, 8, 0, 3] = np.nan
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    expected = np.zeros(ref.shape, dtype=bool)
    if where == "k":
        expected[0, 5] = True
    else:
        expected[0, 5, :, 3] = True
    np.testing.assert_array_equal(np.isnan(ref), expected)
    assert np.isnan(ref_lse[0, :, 5]).all() == (where == "k") and np.isfinite(ref_lse[0, :, :5]).all()
    for out, lse in _all_algorithms(q, k, v, causal=True):
        np.testing.assert_array_equal(np.isnan(out), expected)
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(ref), atol=1e-12)


def test_inf_values_reach_the_same_elements_as_the_reference(rng):
    """+-inf in V: non-finite exactly where the reference is, +inf and -inf of one column meet as NaN."""
    q, k, v = (rng.standard_normal(s) for s in ((1, 7, 2, 8), (1, 11, 2, 8), (1, 11, 2, 8)))
    v[0, 9, 0, 2], v[0, 10, 0, 2], v[0, 4, 1, 6] = np.inf, -np.inf, np.inf
    ref = reference.attention(q, k, v, causal=True)
    assert np.isposinf(ref[0, 5, 0, 2]) and np.isnan(ref[0, 6, 0, 2]) and not np.isfinite(ref[0, 0, 1, 6])
    for out, _ in _all_algorithms(q, k, v, causal=True):
        np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))


def test_rows_that_see_no_key_stay_zero_whatever_the_keys_hold(rng):
    """Nq > Nk with causal: the first rows see no key, so NaN/Inf keys and values leave them
    at O = 0, LSE = -inf; a key whose score is -inf weighs 0 (its NaN value is not read)."""
    q, k, v = (rng.standard_normal(s) for s in ((1, 7, 1, 4), (1, 3, 1, 4), (1, 3, 1, 4)))
    k[0, 0, 0, :], v[0, 1, 0, 0] = np.nan, np.inf
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert (ref[0, :4] == 0).all() and np.isneginf(ref_lse[0, 0, :4]).all()
    for out, lse in _all_algorithms(q, k, v, causal=True):
        assert (out[0, :4] == 0).all() and np.isneginf(lse[0, 0, :4]).all()
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 1, 4), (1, 5, 1, 4), (1, 5, 1, 4)))
    q[0, :, 0, 0], k[0, 3, 0, :], v[0, 3, 0, :] = 1.0, [-np.inf, 0.0, 0.0, 0.0], np.nan  # score -inf
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert np.isfinite(ref).all() and np.isfinite(ref_lse).all()
    for out, lse in _all_algorithms(q, k, v):
        np.testing.assert_allclose(out, ref, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_float64_lse_is_float64_and_merges_exactly(rng):
    """LSE dtype: float32 or the input's dtype, whichever is wider; two float64 halves merge
    back to the whole to float64 precision (not float32's 1e-7)."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 5, 4, 16), (2, 30, 2, 16), (2, 30, 2, 16)))
    full, full_lse = cupyflash.attention(q, k, v, return_lse=True)
    assert full_lse.dtype == np.float64
    a = cupyflash.attention(q, k[:, :11], v[:, :11], return_lse=True)
    b = cupyflash.attention(q, k[:, 11:], v[:, 11:], return_lse=True)
    out, lse = cupyflash.merge_states(*a, *b)
    assert out.dtype == lse.dtype == np.float64
    np.testing.assert_allclose(out, full, atol=1e-13)
    np.testing.assert_allclose(lse, full_lse, atol=1e-13)
    for dtype in (np.float32, np.float16):
        _, lse = cupyflash.attention(*(x.astype(dtype) for x in (q, k, v)), return_lse=True)
        assert lse.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# Host inputs a caller can get wrong, or right in an unusual way (docs/robustness.md).
# ---------------------------------------------------------------------------------------------
def test_torch_cpu_inputs_get_their_gradient(rng):
    """On the host the array-API algorithms run in torch's own namespace, so autograd sees every
    step: a CPU tensor that requires grad gets the gradient of the float64 math."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).requires_grad_(True) for s in ((1, 5, 2, 8), (1, 7, 1, 8),
                                                                                     (1, 7, 1, 8)))  # fmt: skip
    cupyflash.attention(q, k, v, causal=True).square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = (x.repeat_interleave(2, dim=1) for x in (kt, vt))
    mask = torch.from_numpy(reference.visible_keys(5, 7, True, (-1, -1)))
    s = (qt @ kt.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, -math.inf)
    (torch.softmax(s, dim=-1) @ vt).transpose(1, 2).square().sum().backward()
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, x.grad, atol=1e-12, rtol=1e-10)


def test_numpy_bfloat16_is_refused_with_the_way_out():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones((1, 4, 2, 8), dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="NumPy bfloat16 .*convert it to float32"):
        cupyflash.attention(x, x, x)


def test_non_arrays_are_refused():
    x = np.ones((1, 4, 2, 8), dtype=np.float32)
    with pytest.raises(TypeError, match="q must be an array"):
        cupyflash.attention(x.tolist(), x.tolist(), x.tolist())
    with pytest.raises(TypeError, match="v must be an array"):
        cupyflash.attention(x, x, None)
    with pytest.raises(TypeError, match="k must be an array"):  # beside arrays, too
        cupyflash.attention(x, x.tolist(), x)
