"""Rotary embedding in the cache call (flash-attn's rotary_cos / rotary_sin) on the host path,
against rotations written as complex products: the appended keys, the queries' positions."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash


def _tables(rng, positions, half):
    theta = rng.uniform(0, 2 * np.pi, (positions, half))
    return np.cos(theta), np.sin(theta), theta


def _rotated(x, theta_rows, interleaved):
    """x (..., d) with its first 2R columns turned by e^{i theta}: pairs (2i, 2i+1) or (i, i+R)."""
    half = theta_rows.shape[-1]
    x = x.copy()
    if interleaved:
        z = (x[..., 0 : 2 * half : 2] + 1j * x[..., 1 : 2 * half : 2]) * np.exp(1j * theta_rows)
        x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = z.real, z.imag
    else:
        z = (x[..., :half] + 1j * x[..., half : 2 * half]) * np.exp(1j * theta_rows)
        x[..., :half], x[..., half : 2 * half] = z.real, z.imag
    return x


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("causal", "window"), [(True, (-1, -1)), (False, (-1, -1)), (False, (5, 3))])
@pytest.mark.parametrize("rotary_dim", [16, 6])
def test_rotary_append_and_query_positions(rng, interleaved, causal, window, rotary_dim):
    b, length, hq, hkv, d, nq = 3, 40, 4, 2, 16, 3
    q = rng.standard_normal((b, nq, hq, d))
    k, v = (rng.standard_normal((b, length, hkv, d)) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, nq, hkv, d)) for _ in range(2))
    cos, sin, theta = _tables(rng, length, rotary_dim // 2)
    cached = np.array([0, 9, length - nq], dtype=np.int32)
    k_cache, v_cache = k.copy(), v.copy()
    out = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cached, k_new=k_new, v_new=v_new, causal=causal, window=window,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
    )  # fmt: skip
    per_token = causal or window != (-1, -1)
    want_q, want_k, want_v = q.copy(), k.copy(), v.copy()
    for i, n in enumerate(cached):
        key_pos = n + np.arange(nq)
        want_k[i, n : n + nq] = _rotated(k_new[i], theta[key_pos][:, None, :], interleaved)
        want_v[i, n : n + nq] = v_new[i]
        q_pos = n + (np.arange(nq) if per_token else np.zeros(nq, dtype=int))
        want_q[i] = _rotated(q[i], theta[q_pos][:, None, :], interleaved)
    np.testing.assert_allclose(k_cache, want_k, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(v_cache, want_v)
    want = cupyflash.attention_with_kvcache(
        want_q, want_k, want_v, cache_seqlens=cached + nq, causal=causal, window=window
    )
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)


def test_rotary_checks_its_inputs(rng):
    q = rng.standard_normal((1, 1, 2, 16))
    k = rng.standard_normal((1, 8, 2, 16))
    new = rng.standard_normal((1, 1, 2, 16))
    cos = np.ones((8, 4))
    given = {"k_new": new, "v_new": new, "rotary_cos": cos, "rotary_sin": cos}
    call = lambda **kw: cupyflash.attention_with_kvcache(q, k.copy(), k.copy(), cache_seqlens=2, **{**given, **kw})  # noqa: E731
    call()
    with pytest.raises(ValueError, match="go together"):
        call(rotary_sin=None)
    # A table as long as the positions in use is enough (flash-attn's tables may be shorter than
    # the cache): 7 rows, the new key and the query at 2.
    short = {"rotary_cos": cos[:7], "rotary_sin": cos[:7]}
    np.testing.assert_array_equal(call(**short), call())
    with pytest.raises(ValueError, match=r"cache_seqlens=7 .*position 7, past rotary_cos's 7 positions"):
        cupyflash.attention_with_kvcache(q, k.copy(), k.copy(), cache_seqlens=7, **{**given, **short})
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=7 .*position 7, past rotary_cos's 7 positions"):
        cupyflash.attention_with_kvcache(q, k.copy(), k.copy(), cache_seqlens=np.array([7], np.int32),
                                         **{**given, **short})  # fmt: skip
    # three causal query tokens over one new one: query i at cache_seqlens + i
    q3 = rng.standard_normal((1, 3, 2, 16))
    cupyflash.attention_with_kvcache(q3, k.copy(), k.copy(), cache_seqlens=5, causal=True, **given)  # 5 .. 7
    with pytest.raises(ValueError, match="position 9, past rotary_cos's 8 positions"):
        cupyflash.attention_with_kvcache(q3, k.copy(), k.copy(), cache_seqlens=7, causal=True, **given)
    cupyflash.attention_with_kvcache(q3, k.copy(), k.copy(), cache_seqlens=7, causal=False, **given)  # all at 7
    with pytest.raises(ValueError, match="rotary_cos has 2 positions, fewer than the 3 new keys or queries"):
        cupyflash.attention_with_kvcache(q3, k.copy(), k.copy(), cache_seqlens=0, causal=True,
                                         **{**given, "rotary_cos": cos[:2], "rotary_sin": cos[:2]})  # fmt: skip
    with pytest.raises(ValueError, match="must be in 2 .. head_dim"):
        call(rotary_cos=np.ones((8, 9)), rotary_sin=np.ones((8, 9)))
    with pytest.raises(ValueError, match="alike"):
        call(rotary_sin=np.ones((8, 3)))
    with pytest.raises(ValueError, match="need k_new"):
        call(k_new=None, v_new=None)
    with pytest.raises(ValueError, match="rotary_interleaved must be a bool"):
        call(rotary_interleaved=1)
