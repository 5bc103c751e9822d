"""attention's attn_mask (SDPA's) on the host path: against the softmax written out in NumPy, a
key-padding mask against slicing the keys, broadcasting, and the checks."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash


def _formula(q, k, v, bias, causal=False):
    """float64 softmax(q k^T / sqrt(d) + bias) v with GQA, bottom-right causal, bshd."""
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(q.shape[-1]) + bias
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        s = np.where(np.arange(nk)[None] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 5, 9), (1, 4, 5, 9), (2, 1, 1, 9), (4, 1, 9), (5, 9), (1, 1, 5, 1)])
def test_additive_and_boolean_masks_against_the_formula(rng, causal, shape):
    q = rng.standard_normal((2, 5, 4, 16))
    k, v = rng.standard_normal((2, 9, 2, 16)), rng.standard_normal((2, 9, 2, 16))
    additive = rng.standard_normal(shape)
    out = cupyflash.attention(q, k, v, attn_mask=additive, causal=causal)
    np.testing.assert_allclose(out, _formula(q, k, v, np.broadcast_to(additive, (2, 4, 5, 9)), causal), atol=1e-12)
    keep = rng.random(shape) > 0.3
    keep[..., -1] = True  # every row keeps its last key (causal rows see it)
    out = cupyflash.attention(q, k, v, attn_mask=keep, causal=causal)
    bias = np.where(np.broadcast_to(keep, (2, 4, 5, 9)), 0.0, -np.inf)
    np.testing.assert_allclose(out, _formula(q, k, v, bias, causal), atol=1e-12)


def test_key_padding_equals_sliced_keys(rng):
    """A (B, 1, 1, Nk) mask hiding each sequence's first keys (left padding) is the same as
    attending to the rest, with the causal alignment counted over all Nk keys."""
    q = rng.standard_normal((3, 4, 2, 16))
    k, v = rng.standard_normal((3, 12, 2, 16)), rng.standard_normal((3, 12, 2, 16))
    pads = [0, 3, 11]
    keep = np.ones((3, 1, 1, 12), bool)
    for b, n in enumerate(pads):
        keep[b, ..., :n] = False
    out, lse = cupyflash.attention(q, k, v, attn_mask=keep, return_lse=True)
    for b, n in enumerate(pads):
        want, want_lse = cupyflash.attention(q[b : b + 1], k[b : b + 1, n:], v[b : b + 1, n:], return_lse=True)
        np.testing.assert_allclose(out[b : b + 1], want, atol=1e-12)
        np.testing.assert_allclose(lse[b : b + 1], want_lse, atol=1e-12)


def test_a_fully_masked_row_outputs_zero(rng):
    q, k, v = (rng.standard_normal((1, 3, 1, 8)) for _ in range(3))
    keep = np.ones((3, 3), bool)
    keep[1] = False
    out, lse = cupyflash.attention(q, k, v, attn_mask=keep, return_lse=True)
    assert np.all(out[0, 1] == 0) and lse[0, 0, 1] == -np.inf and np.isfinite(lse[0, 0, [0, 2]]).all()


def test_attn_mask_checks(rng):
    q, k, v = (rng.standard_normal((2, 4, 2, 8)) for _ in range(3))
    with pytest.raises(ValueError, match="does not broadcast"):
        cupyflash.attention(q, k, v, attn_mask=np.zeros((3, 4, 4)))
    with pytest.raises(ValueError, match="2 to 4 dims"):
        cupyflash.attention(q, k, v, attn_mask=np.zeros(4))
    with pytest.raises(ValueError, match="softcap or alibi_slopes"):
        cupyflash.attention(q, k, v, attn_mask=np.zeros((4, 4)), softcap=5.0)
    with pytest.raises(ValueError, match="algorithm must be 'auto' or 'fa2'"):
        cupyflash.attention(q, k, v, attn_mask=np.zeros((4, 4)), algorithm="fa3")
    with pytest.raises(TypeError, match="boolean or real floating"):
        cupyflash.attention(q, k, v, attn_mask=np.zeros((4, 4), dtype=np.int32))
    torch = pytest.importorskip("torch")
    qt = torch.randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask gets no gradient"):
        cupyflash.attention(qt, qt, qt, attn_mask=torch.zeros(4, 4, requires_grad=True))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_a_mask_match_autograd_of_the_formula(rng, kind, causal):
    """torch tensors that require grad take the custom op (the host path's backward here): dq, dk,
    dv against torch.autograd of softmax(q k^T / sqrt(d) + mask) v in float64."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 7, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    if kind == "bool":
        mask = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
        mask[..., 0] = True  # every row keeps a key causal rows see
        bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -torch.inf)
    else:
        mask = torch.randn(1, 4, 5, 7, generator=gen, dtype=torch.float64)
        bias = mask
    dout = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64)
    out = cupyflash.attention(q, k, v, attn_mask=mask, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    kk, vv = (x.repeat_interleave(2, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(8) + bias
    if causal:
        s = s.masked_fill(torch.arange(7)[None] > torch.arange(5)[:, None] + 2, -torch.inf)
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, expected in zip(grads, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
