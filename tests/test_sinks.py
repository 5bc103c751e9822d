"""Learnable attention sinks on the host: every host algorithm against the float64 reference (the
sink as one more score column with a zero value), the packed and cache entry points, the backward
(dsinks included) against finite differences and torch's autograd of the formula, the refusals,
and the plans that carry the sinks to the kernels (no GPU needed)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import need_torch

import cupyflash
from cupyflash import _plan, reference
from cupyflash._device import HOPPER
from cupyflash._validate import attention_problem


def _qkv(rng, b=2, nq=5, nk=7, hq=4, hkv=2, d=8):
    q, k, v = (rng.standard_normal(s) for s in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    return q, k, v, rng.standard_normal(hq) * 2


@pytest.mark.parametrize("algorithm", ["auto", "naive", "fa1", "fa2", "decode"])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (2, 1)}, {"softcap": 3.0}], ids=str)
def test_every_host_algorithm(rng, algorithm, options):
    q, k, v, sinks = _qkv(rng)
    out, lse = cupyflash.attention(q, k, v, sinks=sinks, algorithm=algorithm, return_lse=True, **options)
    want, want_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_the_sink_lowers_every_weight_and_joins_the_lse(rng):
    """softmax over [scores, sink] with the sink's column dropped: out = out_without * (1 - p_sink)."""
    q, k, v, sinks = _qkv(rng)
    plain, plain_lse = cupyflash.attention(q, k, v, return_lse=True)
    out, lse = cupyflash.attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(lse, np.logaddexp(plain_lse, sinks[None, :, None]))
    kept = np.exp(plain_lse - lse).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(out, plain * kept, atol=1e-12)


def test_rows_without_keys_take_the_sink_and_minus_infinity_is_none(rng):
    q, k, v, sinks = _qkv(rng, nq=6, nk=2)
    out, lse = cupyflash.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    assert (out[:, :4] == 0).all()  # rows 0-3 see no key (bottom-right causal)
    np.testing.assert_array_equal(lse[:, :, :4], np.broadcast_to(sinks[None, :, None], (2, 4, 4)))
    none = np.full_like(sinks, -np.inf)
    plain = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    with_none = cupyflash.attention(q, k, v, causal=True, sinks=none, return_lse=True)
    for a, b in zip(plain, with_none, strict=True):
        np.testing.assert_array_equal(a, b)


def test_nan_sink_gives_nan_in_its_head(rng):
    q, k, v, sinks = _qkv(rng)
    sinks[1] = np.nan
    out, lse = cupyflash.attention(q, k, v, sinks=sinks, return_lse=True)
    assert np.isnan(out[:, :, 1]).all() and np.isnan(lse[:, 1]).all()
    assert not np.isnan(np.delete(out, 1, axis=2)).any()


def test_varlen_and_cache_calls(rng):
    q, k, v, sinks = _qkv(rng, b=1, nq=9, nk=12)
    cu_q, cu_k = np.array([0, 4, 9], np.int32), np.array([0, 5, 12], np.int32)
    out, lse = cupyflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 5, 7, causal=True, sinks=sinks,
                                          return_lse=True)  # fmt: skip
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, want_lse = reference.attention(q[:, rows], k[:, keys], v[:, keys], causal=True, sinks=sinks,
                                             return_lse=True)  # fmt: skip
        np.testing.assert_allclose(out[rows], want[0], atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], want_lse[0], atol=1e-12)
    k_cache, v_cache = np.zeros((1, 16, 2, 8)), np.zeros((1, 16, 2, 8))
    k_cache[:, :10], v_cache[:, :10] = k[:, :10], v[:, :10]
    out, lse = cupyflash.attention_with_kvcache(
        q[:, :2], k_cache, v_cache, cache_seqlens=8, k_new=k[:, 8:10], v_new=v[:, 8:10], sinks=sinks, return_lse=True
    )
    want, want_lse = reference.attention(q[:, :2], k[:, :10], v[:, :10], causal=True, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_against_finite_differences(rng, causal):
    """Every gradient, dsinks included, of a loss on both out and lse."""
    q, k, v, sinks = _qkv(rng, nq=6, nk=4)
    dout, dlse = rng.standard_normal(q.shape), rng.standard_normal((2, 4, 6))

    def loss(q, k, v, sinks):
        out, lse = cupyflash.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
        return float((out * dout).sum() + (lse * dlse).sum())

    out, lse = cupyflash.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal=causal, sinks=sinks)
    assert len(grads) == 4 and grads[3].shape == (4,)
    args, eps = [q, k, v, sinks], 1e-6
    for which, grad in enumerate(grads):
        x = args[which]
        for index in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(4)]:
            up, down = [a.copy() for a in args], [a.copy() for a in args]
            up[which][index] += eps
            down[which][index] -= eps
            numeric = (loss(*up) - loss(*down)) / (2 * eps)
            np.testing.assert_allclose(grad[index], numeric, rtol=1e-5, atol=1e-7)


def test_varlen_backward_sums_the_sequences(rng):
    q, k, v, sinks = _qkv(rng, b=1, nq=9, nk=12)
    cu_q, cu_k = np.array([0, 4, 9], np.int32), np.array([0, 5, 12], np.int32)
    out, lse = cupyflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 5, 7, sinks=sinks, return_lse=True)
    dout = rng.standard_normal(out.shape)
    grads = cupyflash.attention_varlen_backward(dout, q[0], k[0], v[0], out, lse, cu_q, cu_k, 5, 7, sinks=sinks)
    total = np.zeros(4)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = cupyflash.attention(q[:, rows], k[:, keys], v[:, keys], sinks=sinks, return_lse=True)  # noqa: E741
        total += cupyflash.attention_backward(dout[None, rows], q[:, rows], k[:, keys], v[:, keys], o, l,
                                              sinks=sinks)[3]  # fmt: skip
    np.testing.assert_allclose(grads[3], total, atol=1e-12)


def test_torch_autograd_gives_the_sinks_their_gradient(rng):
    torch = need_torch()
    q, k, v, sinks = (torch.tensor(x, requires_grad=True) for x in _qkv(rng))
    out, lse = cupyflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    (out.square().sum() + lse.sum()).backward()
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    qt, kt, vt = (x.transpose(1, 2) for x in ref[:3])
    kt, vt = kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1)
    s = (qt @ kt.transpose(-1, -2)) / 8**0.5
    s = s.masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(3), float("-inf"))
    s = torch.cat([s, ref[3][None, :, None, None].expand(2, 4, 5, 1)], -1)
    want = (s.softmax(-1)[..., :-1] @ vt).transpose(1, 2)
    (want.square().sum() + torch.logsumexp(s, -1).sum()).backward()
    for got, r in zip((q, k, v, sinks), ref, strict=True):
        torch.testing.assert_close(got.grad, r.grad)


def test_refusals(rng):
    q, k, v, sinks = _qkv(rng)
    with pytest.raises(ValueError, match=r"sinks must have shape \(nheads,\) = \(4,\)"):
        cupyflash.attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(TypeError, match="sinks must have a real floating dtype"):
        cupyflash.attention(q, k, v, sinks=np.zeros(4, dtype=np.int32))
    with pytest.raises(ValueError, match="the FP8 forward takes no score_mod / mask_mod or sinks"):
        cupyflash.attention(q, k, v, sinks=sinks, q_descale=1.0)


def test_the_plans_carry_the_sinks():
    """The forward's plans read the sinks where every kernel family reads its options, and the
    backward's returns each row's share of dsinks (summed per head by the caller)."""
    h100 = HOPPER
    shapes = ((2, 300, 8, 128), (2, 500, 2, 128), (2, 500, 2, 128))
    p = attention_problem(*shapes, causal=True, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")
    p = replace(p, sinks=True)
    for algorithm in ("fa2", "fa3"):
        launch = _plan.plan_attention(p, "bfloat16", h100, algorithm, (2, 300, 8, 128))
        assert "sinks" in [o.name for o in launch.operands], algorithm
    one = replace(p, seqlen_q=1)
    launch = _plan.plan_attention(one, "bfloat16", h100, "auto", (2, 1, 8, 128))
    assert "sinks" in [o.name for o in launch.operands]  # the decode kernel
    none = replace(p, seqlen_k=0)
    assert _plan.plan_attention(none, "bfloat16", h100, "auto", (2, 300, 8, 128)).steps  # runs for the sink's LSE
    back = _plan.plan_backward(p, "bfloat16", h100, q_shape=(2, 300, 8, 128), k_shape=(2, 500, 2, 128))
    (rows,) = [o for o in back.outputs if o.name == "dsink_rows"]
    assert rows.dtype == "float32" and rows.shape[:2] == (2, 8) and rows.shape[2] >= 300


def test_transformers_passes_gpt_oss_sinks(rng):
    """gpt-oss hands its sinks to the attention function as ``s_aux`` (its own dtype): cast to
    float32 and applied, with their gradient."""
    torch = need_torch()
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from cupyflash.integrations import transformers as cft

    q, k, v, sinks = (torch.tensor(x) for x in _qkv(rng, nq=6, nk=6))
    s_aux = sinks.to(torch.bfloat16).requires_grad_()
    out, _ = cft.attention_forward(SimpleNamespace(is_causal=True), q.transpose(1, 2), k.transpose(1, 2),
                                   v.transpose(1, 2), None, scaling=0.25, s_aux=s_aux)  # fmt: skip
    want = reference.attention(q, k, v, causal=True, scale=0.25, sinks=s_aux.detach().float())
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-6)
    out.sum().backward()
    assert s_aux.grad is not None and s_aux.grad.dtype == torch.bfloat16
