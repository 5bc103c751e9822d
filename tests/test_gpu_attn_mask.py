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
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80), ("float16", 192), ("bfloat16", 224)]
)
@pytest.mark.parametrize("nk", [301, 320], ids=["keys-read-per-score", "keys-staged"])
def test_mask_matches_the_host_twin(rng, kind, shape, options, dtype, head_dim, nk):
    """301 keys: the mask's rows are not 16-byte aligned, the kernel reads it per score; 320: its
    mixed tiles are staged through shared memory with K and V (AttnBias::stageable)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, nq, hq, hkv = 2, 197, 8, 2
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


@pytest.mark.parametrize("nk", [500, 512])
def test_key_padding_equals_sliced_keys_and_expanded_masks(rng, nk):
    """A left-padding mask (B, 1, 1, Nk) gives the bits of the mask expanded to (B, Hq, Nq, Nk)
    with stride 0 (read in place) and matches attention over each sequence's kept keys (512 keys:
    the mixed tiles staged through shared memory)."""
    torch = need_torch()
    b, nq, hq, hkv, d = 3, 64, 8, 2, 128
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
@pytest.mark.parametrize(("head_dim", "causal"), [(64, True), (128, False), (80, True), (192, False), (256, True)])
def test_mask_gradients_on_the_gpu(rng, kind, deterministic, head_dim, causal):
    """The FA2 backward with the mask as its score variant (atomic and deterministic dQ): dq, dk,
    dv of bf16 inputs against autograd of the float64 formula (the error rule of
    helpers.check_forward_backward_against_formula)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, nq, nk, hq = 2, 150, 211, 4
    if kind == "bool":
        mask = torch.rand(b, 1, 1, nk, generator=gen) > 0.3
        mask[..., -1] = True
    else:
        mask = torch.randn(1, hq, nq, nk, generator=gen, dtype=torch.float64)
    _check_mask_gradients(torch, gen, (b, nq, nk, hq, 2, head_dim), mask, causal, deterministic)


def _check_mask_gradients(torch, gen, dims, mask, causal, deterministic):
    """dq, dk, dv of bf16 inputs (b, nq, nk, hq, hkv, d) with ``mask`` (boolean, or a float64
    bias rounded to bf16) against autograd of the float64 formula with the same mask."""
    b, nq, nk, hq, hkv, head_dim = dims
    q = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, nk, hkv, head_dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2))  # fmt: skip
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -torch.inf).cuda()
        mask = mask.cuda()
    else:
        mask = mask.to("cuda", torch.bfloat16)
        bias = mask.double()
    dout = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    out = cupyflash.attention(q, k, v, attn_mask=mask, causal=causal, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_forward_backward_against_formula(
        out, grads, q, k, v, dout, causal=causal, window=(-1, -1), softcap=0.0, scale=None, bias=bias
    )


def _block_mask(torch, gen, dims, kind, grain):
    """A mask of grain x grain blocks, each hiding every key, showing every key as it is, or
    random (the three states of the kernels' block summary, at cells of any alignment to them)."""
    b, h, nq, nk = dims
    states = torch.randint(0, 3, (b, h, -(-nq // grain), -(-nk // grain)), generator=gen)
    states = states.repeat_interleave(grain, 2).repeat_interleave(grain, 3)[:, :, :nq, :nk]
    if kind == "bool":
        return torch.where(states == 0, False, torch.where(states == 1, True, torch.rand(dims, generator=gen) > 0.5))
    noise = torch.randn(dims, generator=gen, dtype=torch.float64) * 2
    return torch.where(states == 0, -torch.inf, torch.where(states == 1, 0.0, noise))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("grain", [16, 128])
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64)])
def test_block_sparse_masks_skip_hidden_tiles(rng, kind, grain, options, dtype, head_dim):
    """Masks whose blocks hide every key, show every key or mix (the kernels skip the first kind
    and do not read the second) against the float64 host twin; rows the mask hides entirely are
    0 with LSE -inf there and here."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, nq, nk, hq, hkv = 2, 300, 560, 4, 2  # 16-byte rows: the mixed tiles staged
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(b, n, h, head_dim, generator=gen).to(tdtype) for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
    mask = _block_mask(torch, gen, (b, 1, nq, nk), kind, grain)
    mask[0, 0, 5:9] = False if kind == "bool" else -torch.inf  # rows that see no key
    host_mask = mask.numpy() if kind == "bool" else mask.to(tdtype).double().numpy()
    want, want_lse = cupyflash.attention(*(x.double().numpy() for x in (q, k, v)), attn_mask=host_mask,
                                         return_lse=True, **options)  # fmt: skip
    gpu_mask = mask.cuda() if kind == "bool" else mask.to("cuda", tdtype)
    out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), attn_mask=gpu_mask, return_lse=True, **options)
    assert rel_error(reference.to_numpy64(out), want) < BOUND[dtype]
    got_lse, finite = reference.to_numpy64(lse), np.isfinite(want_lse)
    assert (np.isfinite(got_lse) == finite).all() and (~finite).any()
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-2)
    assert (reference.to_numpy64(out)[0, 5:9] == 0).all()


def test_masks_that_show_every_key_are_not_read_and_nan_still_reaches_the_output():
    """An all-true boolean mask and an all-zero additive one both take the tiles' unread path:
    the same bits. A NaN in an otherwise zero block is not skipped: its row is NaN."""
    torch = need_torch()
    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    shown = cupyflash.attention(q, k, v, attn_mask=torch.ones(200, 200, dtype=torch.bool, device="cuda"))
    zero = cupyflash.attention(q, k, v, attn_mask=torch.zeros(1, 4, 200, 200, dtype=torch.float16, device="cuda"))
    assert torch.equal(shown, zero)
    bias = torch.zeros(2, 1, 200, 200, dtype=torch.float16, device="cuda")
    bias[1, 0, 77, 150] = torch.nan
    out = cupyflash.attention(q, k, v, attn_mask=bias)
    assert torch.isnan(out[1, 77]).all() and not torch.isnan(out[1, :77]).any() and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("head_dim", "causal"), [(64, False), (128, True)])
def test_block_sparse_mask_gradients(rng, kind, deterministic, head_dim, causal):
    """The backward skips the tiles a mask hides (in the key-block kernel and the deterministic dQ
    kernel, whose tiles differ: one summary of the smaller cells serves both)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, nq, nk, hq = 2, 190, 333, 4
    mask = _block_mask(torch, gen, (b, hq, nq, nk), kind, 32)
    for key in (0, -1):  # every row sees a key, under causal too (the formula's softmax)
        mask[..., key] = True if kind == "bool" else 0.0
    _check_mask_gradients(torch, gen, (b, nq, nk, hq, 2, head_dim), mask, causal, deterministic)
