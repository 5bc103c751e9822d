"""Learnable attention sinks on the GPU kernels, against the float64 reference (a sink column in
every row's softmax, with a zero value) and the float64 host path for the gradients: the FA2 and
Hopper forwards (dense, packed, paged), the decode kernel (one split and many, contiguous and
paged caches, k_new appended), the backward's dsinks (both backward kernels, deterministic too)
and PyTorch autograd. Rows that see no key output 0 with LSE = the sink; a NaN sink gives NaN.
Outputs are NaN-poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, need_torch, paginate, rel_error

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu

HQ, HKV = 8, 2


def _inputs(torch, gen, b, nq, nk, d, dtype):
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(tdtype) for n, h in ((nq, HQ), (nk, HKV), (nk, HKV)))
    sinks = (torch.randn(HQ, generator=gen) * 2).float()
    return q, k, v, sinks


def _check(out, lse, want, want_lse, dtype):
    got = reference.to_numpy64(out)
    assert rel_error(got, want) < BOUND[dtype]
    np.testing.assert_allclose(reference.to_numpy64(lse), want_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("algorithm", ["auto", "fa2", "fa3"])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (40, 7)}, {"softcap": 20.0}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80)])
def test_forward(rng, algorithm, options, dtype, head_dim):
    torch = need_torch()
    if algorithm == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel")
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, sinks = _inputs(torch, gen, 2, 197, 301, head_dim, dtype)
    want, want_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), sinks=sinks.cuda(), return_lse=True,
                                   algorithm=algorithm, **options)  # fmt: skip
    _check(out, lse, want, want_lse, dtype)


def test_rows_without_keys_and_no_keys_at_all(rng):
    """Causal rows past the keys see none: output 0 and LSE = the sink; no key at all runs the
    FA2 kernel over no key block for the same answer."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, sinks = _inputs(torch, gen, 2, 90, 33, 64, "float16")
    out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), sinks=sinks.cuda(), causal=True, return_lse=True)
    want, want_lse = reference.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    _check(out, lse, want, want_lse, "float16")
    assert (out[:, :57].cpu() == 0).all()
    out, lse = cupyflash.attention(q.cuda(), k[:, :0].cuda(), v[:, :0].cuda(), sinks=sinks.cuda(), return_lse=True)
    assert (out.cpu() == 0).all()
    np.testing.assert_array_equal(lse.cpu().numpy(), np.broadcast_to(sinks.numpy()[None, :, None], lse.shape))


def test_nan_sink_gives_nan_in_its_head_only(rng):
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, sinks = _inputs(torch, gen, 1, 64, 64, 64, "bfloat16")
    sinks[3] = float("nan")
    out = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), sinks=sinks.cuda()).float().cpu()
    assert torch.isnan(out[:, :, 3]).all()
    assert not torch.isnan(out[:, :, [0, 1, 2, 4, 5, 6, 7]]).any()


@pytest.mark.parametrize("page_size", [0, 16])
def test_varlen_and_paged(rng, page_size):
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    lens_q, lens_k = [37, 1, 130], [61, 17, 130]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q, k, v, sinks = _inputs(torch, gen, 1, sum(lens_q), sum(lens_k), 64, "bfloat16")
    q, k, v = q[0], k[0], v[0]
    want, want_lse = cupyflash.attention_varlen(
        q.double(), k.double(), v.double(), cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
        sinks=sinks.double(), return_lse=True,
    )  # fmt: skip
    kwargs = {}
    keys, values = k.cuda(), v.cuda()
    if page_size:  # each sequence's keys from 0 in its own pages
        dense = np.zeros((2, len(lens_k), max(lens_k), HKV, 64), dtype=np.float32)
        for b, (k0, k1) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
            dense[0, b, : k1 - k0], dense[1, b, : k1 - k0] = k[k0:k1].float().numpy(), v[k0:k1].float().numpy()
        (keys, values), table = paginate(rng, list(dense), page_size)
        keys, values = (torch.from_numpy(x).to(torch.bfloat16).cuda() for x in (keys, values))
        kwargs["block_table"] = torch.from_numpy(table).cuda()
    out, lse = cupyflash.attention_varlen(
        q.cuda(), keys, values, cu_q.cuda(), cu_k.cuda(), max(lens_q), max(lens_k), causal=True, sinks=sinks.cuda(),
        return_lse=True, **kwargs,
    )  # fmt: skip
    _check(out, lse, want.numpy(), want_lse.numpy(), "bfloat16")


@pytest.mark.parametrize("num_splits", [1, 0, 7])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("queries", [1, 4])
def test_decode(rng, num_splits, paged, queries):
    """The decode kernel: one split adds the sink in its epilogue, several in the merge."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, cap, d = 3, 4096, 128
    q, k, v, sinks = _inputs(torch, gen, b, queries, cap, d, "bfloat16")
    lengths = torch.tensor([4000, 1, 2311], dtype=torch.int32)
    k_new, v_new = (torch.randn(b, queries, HKV, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    want_k, want_v = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        want_k[i, n : n + queries], want_v[i, n : n + queries] = k_new[i], v_new[i]
    kwargs = {}
    if paged:
        (kc, vc), table = paginate(rng, [k.float().numpy(), v.float().numpy()], 16)
        kc, vc = (torch.from_numpy(x).to(torch.bfloat16).cuda() for x in (kc, vc))
        kwargs["block_table"] = torch.from_numpy(table).cuda()
    else:
        kc, vc = k.cuda(), v.cuda()
    out, lse = cupyflash.attention_with_kvcache(
        q.cuda(), kc, vc, cache_seqlens=lengths.cuda(), k_new=k_new.cuda(), v_new=v_new.cuda(), causal=True,
        num_splits=num_splits, sinks=sinks.cuda(), return_lse=True, **kwargs,
    )  # fmt: skip
    for i, n in enumerate(lengths.tolist()):
        n += queries
        want, want_lse = reference.attention(q[i : i + 1], want_k[i : i + 1, :n], want_v[i : i + 1, :n], causal=True,
                                             sinks=sinks, return_lse=True)  # fmt: skip
        _check(out[i : i + 1], lse[i : i + 1], want, want_lse, "bfloat16")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_backward_against_the_host(rng, deterministic, options, head_dim):
    """dq, dk, dv and dsinks (with a dlse, as a loss on the LSE gives) against the float64 host
    path on the same values."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, sinks = _inputs(torch, gen, 2, 257, 190, head_dim, "bfloat16")
    out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), sinks=sinks.cuda(), return_lse=True, **options)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    dlse = torch.randn(lse.shape, generator=gen)
    grads = cupyflash.attention_backward(
        dout.cuda(), q.cuda(), k.cuda(), v.cuda(), out, lse, dlse=dlse.cuda(), sinks=sinks.cuda(),
        deterministic=deterministic, **options,
    )  # fmt: skip
    host = [x.double() for x in (dout, q, k, v, out.cpu(), lse.cpu(), dlse, sinks)]
    want = cupyflash.attention_backward(*host[:6], dlse=host[6], sinks=host[7], **options)
    assert len(grads) == 4 and grads[3].dtype == torch.float32 and grads[3].shape == (HQ,)
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, want, strict=True):
        assert rel_error(reference.to_numpy64(got), ref.numpy()) < 2e-2, name


def test_torch_autograd_against_the_formula(rng):
    """A training step through autograd: every gradient, the sinks' included, against torch's own
    autograd of the formula in float64."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, sinks = _inputs(torch, gen, 2, 129, 129, 64, "bfloat16")
    leaves = [x.cuda().requires_grad_() for x in (q, k, v, sinks)]
    out = cupyflash.attention(*leaves[:3], causal=True, sinks=leaves[3])
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16).cuda()
    out.backward(dout)
    ref = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    qt, kt, vt = (x.transpose(1, 2) for x in ref[:3])
    kt, vt = kt.repeat_interleave(HQ // HKV, 1), vt.repeat_interleave(HQ // HKV, 1)
    s = (qt @ kt.transpose(-1, -2)) / 8.0
    s = s.masked_fill(torch.ones(129, 129, dtype=torch.bool).triu(1), float("-inf"))
    s = torch.cat([s, ref[3][None, :, None, None].expand(2, HQ, 129, 1)], -1)
    want = (s.softmax(-1)[..., :-1] @ vt).transpose(1, 2)
    want.backward(dout.cpu().double())
    assert rel_error(reference.to_numpy64(out.detach()), want.detach().numpy()) < BOUND["bfloat16"]
    for name, got, r in zip("q k v sinks".split(), leaves, ref, strict=True):
        assert rel_error(reference.to_numpy64(got.grad), r.grad.numpy()) < 2e-2, name
