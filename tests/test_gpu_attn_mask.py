"""attention's attn_mask on the GPU (the FA2 kernel with the mask as a score variant): against
the float64 host twin on the same values, a key-padding mask against sliced keys, broadcast and
expanded (stride 0) masks, with causal, windows and dropout. Outputs are NaN-poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, check_forward_backward_against_formula, need_torch, rel_error

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu

MASK_SHAPES = {
    "full": lambda b, h, nq, nk: (b, h, nq, nk),
    "heads": lambda b, h, nq, nk: (1, h, nq, nk),
    "keys": lambda b, h, nq, nk: (b, 1, 1, nk),
    "2d": lambda b, h, nq, nk: (nq, nk),
}


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES), ids=str)
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (40, 7)}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80)])
def test_mask_matches_the_host_twin(rng, kind, shape, options, dtype, head_dim):
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, nq, nk, hq, hkv = 2, 197, 301, 8, 2
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(b, n, h, head_dim, generator=gen).to(tdtype) for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
    dims = MASK_SHAPES[shape](b, hq, nq, nk)
    if kind == "bool":
        mask = torch.rand(dims, generator=gen) > 0.4
        mask[..., -1] = True
    else:
        mask = (torch.randn(dims, generator=gen) * 2).to(tdtype)
    host = [x.double().numpy() for x in (q, k, v)]
    want, want_lse = cupyflash.attention(*host, attn_mask=mask.numpy() if kind == "bool" else mask.double().numpy(),
                                         return_lse=True, **options)  # fmt: skip
    out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), attn_mask=mask.cuda(), return_lse=True, **options)
    assert out.dtype == tdtype and out.shape == q.shape
    assert rel_error(reference.to_numpy64(out), want) < BOUND[dtype]
    got_lse, finite = reference.to_numpy64(lse), np.isfinite(want_lse)
    assert (np.isfinite(got_lse) == finite).all()
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-2)


def test_key_padding_equals_sliced_keys_and_expanded_masks(rng):
    """A left-padding mask (B, 1, 1, Nk) gives the bits of the mask expanded to (B, Hq, Nq, Nk)
    with stride 0 (read in place) and matches attention over each sequence's kept keys."""
    torch = need_torch()
    b, nq, nk, hq, hkv, d = 3, 64, 500, 8, 2, 128
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pads = [0, 77, 499]
    keep = torch.ones(b, 1, 1, nk, dtype=torch.bool, device="cuda")
    for i, n in enumerate(pads):
        keep[i, ..., :n] = False
    out = cupyflash.attention(q, k, v, attn_mask=keep)
    expanded = cupyflash.attention(q, k, v, attn_mask=keep.expand(b, hq, nq, nk))
    assert torch.equal(out, expanded)
    for i, n in enumerate(pads):
        want = reference.attention(q[i : i + 1], k[i : i + 1, n:], v[i : i + 1, n:])
        assert rel_error(reference.to_numpy64(out[i : i + 1]), want) < BOUND["bfloat16"]


def test_mask_with_dropout_matches_the_host_twin(rng):
    """The dropout draw is a function of the seed and the element, on the GPU and the host alike."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (torch.randn(2, 130, 4, 64, generator=gen).half() for _ in range(3))
    mask = torch.randn(2, 4, 130, 130, generator=gen).half()
    want = cupyflash.attention(*(x.double().numpy() for x in (q, k, v)), attn_mask=mask.double().numpy(),
                               dropout_p=0.2, seed=1234, causal=True)  # fmt: skip
    out = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), attn_mask=mask.cuda(), dropout_p=0.2, seed=1234,
                              causal=True)  # fmt: skip
    assert rel_error(reference.to_numpy64(out), want) < BOUND["float16"]


def test_mask_gpu_checks():
    torch = need_torch()
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="additive attn_mask must have q's dtype"):
        cupyflash.attention(q, q, q, attn_mask=torch.zeros(16, 16, device="cuda"))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("head_dim", "causal"), [(64, True), (128, False), (80, True)])
def test_mask_gradients_on_the_gpu(rng, kind, deterministic, head_dim, causal):
    """The FA2 backward with the mask as its score variant (atomic and deterministic dQ): dq, dk,
    dv of bf16 inputs against autograd of the float64 formula (the error rule of
    helpers.check_forward_backward_against_formula)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, nq, nk, hq, hkv = 2, 150, 211, 4, 2
    q = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, nk, hkv, head_dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2))  # fmt: skip
    if kind == "bool":
        mask = (torch.rand(b, 1, 1, nk, generator=gen) > 0.3).cuda()
        mask[..., -1] = True
        bias = torch.zeros(mask.shape, device="cuda", dtype=torch.float64).masked_fill(~mask, -torch.inf)
    else:
        mask = torch.randn(1, hq, nq, nk, generator=gen).to("cuda", torch.bfloat16)
        bias = mask.double()
    dout = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    out = cupyflash.attention(q, k, v, attn_mask=mask, causal=causal, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_forward_backward_against_formula(
        out, grads, q, k, v, dout, causal=causal, window=(-1, -1), softcap=0.0, scale=None, bias=bias
    )
