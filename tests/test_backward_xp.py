"""The array-API backward (``cupyflash.attention_backward`` on host arrays) against PyTorch
autograd through a float64 naive attention: causal (bottom-right, rows that see no key), windows,
softcap, GQA, both layouts, awkward lengths, and NaN in, NaN out."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

torch = pytest.importorskip("torch")


def _autograd(q, k, v, dout, *, causal, window, softcap, scale, layout, dlse=None):
    """(dq, dk, dv) of a float64 naive attention by torch autograd (the oracle), for the loss
    sum(o * dout) (+ sum(lse * dlse))."""
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    qs, ks, vs = (x.transpose(1, 2) if layout == "bshd" else x for x in (tq, tk, tv))  # [B, H, N, d]
    group = qs.shape[1] // ks.shape[1]
    ks, vs = (x.repeat_interleave(group, dim=1) for x in (ks, vs))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (qs @ ks.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = torch.from_numpy(reference.visible_keys(qs.shape[2], ks.shape[2], causal, window))
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0) if not torch.isnan(s).any() else torch.softmax(s, dim=-1)
    o = p @ vs
    o = o.transpose(1, 2) if layout == "bshd" else o
    loss = (o * torch.tensor(dout, dtype=torch.float64)).sum()
    if dlse is not None:
        loss = loss + (torch.logsumexp(s, dim=-1) * torch.tensor(dlse, dtype=torch.float64)).sum()
    loss.backward()
    return tuple(x.grad.numpy() for x in (tq, tk, tv))


CASES = [
    # (B, Nq, Nk, Hq, Hkv, d), options
    ((2, 37, 53, 4, 2, 16), {}),
    ((1, 64, 64, 2, 2, 32), {"causal": True}),
    ((2, 97, 70, 6, 2, 8), {"causal": True}),  # Nq > Nk: the first rows see no key
    ((1, 130, 200, 4, 1, 16), {"window": (20, 5)}),
    ((1, 70, 90, 2, 1, 16), {"causal": True, "window": (30, -1), "softcap": 3.0, "scale": 0.7}),
    ((2, 1, 300, 8, 2, 16), {}),  # one query token
    ((1, 65, 129, 3, 3, 24), {"softcap": 1.5}),
]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(("dims", "options"), CASES)
def test_backward_matches_autograd(rng, dims, options, layout):
    b, nq, nk, hq, hkv, d = dims
    shape = (lambda n, h: (b, n, h, d)) if layout == "bshd" else (lambda n, h: (b, h, n, d))
    q, k, v = (rng.standard_normal(s) for s in (shape(nq, hq), shape(nk, hkv), shape(nk, hkv)))
    dout = rng.standard_normal(q.shape)
    kwargs = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    out, lse = cupyflash.attention(q, k, v, layout=layout, return_lse=True, **kwargs)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, layout=layout, **kwargs)
    expected = _autograd(q, k, v, dout, layout=layout, **kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert got.shape == want.shape and got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=name)


def test_float32_inputs_give_float32_gradients_close_to_float64(rng):
    q, k, v = (rng.standard_normal((1, 50, 2, 32)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    expected = _autograd(q, k, v, dout, causal=True, window=(-1, -1), softcap=0.0, scale=None, layout="bshd")
    for got, want in zip(grads, expected):
        assert got.dtype == np.float32
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_nan_in_gives_nan_out(rng):
    q, k, v = (rng.standard_normal((1, 8, 1, 16)) for _ in range(3))
    k[0, 3, 0, 0] = np.nan
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse)
    assert np.isnan(dq).all(axis=-1).all() and np.isnan(dv).any()


def test_shapes_are_checked(rng):
    q = rng.standard_normal((1, 8, 2, 16))
    out, lse = cupyflash.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="dout must have shape"):
        cupyflash.attention_backward(out[:, :4], q, q, q, out, lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        cupyflash.attention_backward(out, q, q, q, out, lse[:, :1])


def test_lse_gradient_enters_as_minus_d(rng):
    """A loss that uses the returned LSE: dS gains P * dlse (D - dlse in the kernels' terms)."""
    q, k, v = (rng.standard_normal((2, n, 2, 16)) for n in (9, 13, 13))
    dout, dlse = rng.standard_normal(q.shape), rng.standard_normal((2, 2, 9))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal=True)
    expected = _autograd(q, k, v, dout, causal=True, window=(-1, -1), softcap=0.0, scale=None, layout="bshd", dlse=dlse)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=name)


def test_varlen_backward_is_each_sequence_and_zero_between(rng):
    """attention_varlen_backward on host arrays: each sequence's gradients as autograd's, the
    packed rows after the last sequence zero; an empty and a one-token sequence included."""
    lens_q, lens_k = [5, 0, 1, 17], [7, 3, 1, 17]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    tq, tk = int(cu_q[-1]) + 2, int(cu_k[-1])
    q, k, v = rng.standard_normal((tq, 4, 16)), rng.standard_normal((tk, 2, 16)), rng.standard_normal((tk, 2, 16))
    dout = rng.standard_normal(q.shape)
    opts = {"causal": True, "softcap": 2.0}
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 17, 17, return_lse=True, **opts)
    dq, dk, dv = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 17, 17, **opts)
    for b in range(len(lens_q)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            np.testing.assert_array_equal(dk[rk], 0.0)
            continue
        want = _autograd(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], window=(-1, -1), scale=None,
                         layout="bshd", **opts)  # fmt: skip
        for got, w in zip((dq[rq], dk[rk], dv[rk]), want):
            np.testing.assert_allclose(got, w[0], rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(dq[cu_q[-1] :], 0.0)
