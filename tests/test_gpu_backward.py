"""The GPU backward (kernels_cu/fa2_bwd.cu; on Hopper fa3_bwd.cu where it has the variant)
against PyTorch autograd of a float64 naive attention on the same rounded inputs: dq, dk and dv
within the dtype's bound and within 2x the error of the same naive backward run in the inputs'
own precision (flash-attn's rule) plus a rounding floor.

Outputs are NaN-poisoned before every launch (conftest), so a gradient row the kernels fail to
write shows up as NaN. Cases: every backward head dim, both dtypes, causal (bottom-right, rows
that see no key), windows, softcap, GQA/MQA, odd lengths, both layouts, negative and zero scale,
a loss through the LSE, packed sequences with empty and one-token ones (and each option, a
NaN-holding neighbour, a sequence longer than max_seqlen_k), NaN in, CuPy inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, FLOOR, is_hopper, naive_low_precision, need_torch, rel_error

import cupyflash
from cupyflash._specs import FA2_BWD_HEAD_DIMS

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")
# (B, Nq, Nk, Hq, Hkv, causal, window, softcap)
CASES = {
    "square": (2, 128, 128, 4, 4, False, (-1, -1), 0.0),
    "causal-gqa-odd": (1, 97, 200, 6, 2, True, (-1, -1), 0.0),
    "causal-mqa-nq>nk": (2, 200, 97, 4, 1, True, (-1, -1), 0.0),
    "one-query": (1, 1, 300, 4, 2, False, (-1, -1), 0.0),
    "window-causal": (1, 257, 257, 2, 2, True, (64, -1), 0.0),
    "window-both": (1, 300, 301, 4, 2, False, (16, 16), 0.0),
    "softcap-causal": (1, 190, 301, 4, 2, True, (-1, -1), 30.0),
    "window-softcap": (2, 130, 70, 2, 1, False, (-1, 3), 5.0),
    # Many steps per key block (the Hopper kernel's ring wraps 60 times, GQA group of 8).
    "causal-gqa-long": (1, 1000, 1000, 8, 1, True, (-1, -1), 0.0),
    # Many key blocks add into each dQ tile (32 of 128 keys; a window's band of them).
    "many-key-blocks": (1, 300, 4000, 4, 2, False, (-1, -1), 0.0),
    "window-long": (1, 2000, 2100, 2, 1, True, (300, -1), 0.0),
    # The Hopper kernel's 128-row steps at d = 64: the last step's second 64-row tile all padding.
    "half-step": (2, 192, 256, 4, 2, True, (-1, -1), 0.0),
    # 7 (batch, KV head) pairs of several key blocks: the causal CTA order's sections of 4 and 3.
    "causal-lpt-sections": (7, 700, 700, 2, 1, True, (-1, -1), 0.0),
}


def _grads(torch, q, k, v, dout, dtype, dlse=None, **options):
    """(dq, dk, dv) of the naive attention by autograd, in ``dtype`` (float64: the oracle)."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out, lse = naive_low_precision(*leaves, return_lse=True, **options)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    return [x.grad for x in leaves]


def check_backward(torch, q, k, v, *, dlse=None, deterministic=False, **options):
    """Forward and backward through cupyflash; each gradient against the float64 oracle."""
    dout = torch.randn_like(q)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, deterministic=deterministic, **options)
    want = _grads(torch, q, k, v, dout, torch.float64, dlse=dlse, **options)
    naive = _grads(torch, q, k, v, dout, q.dtype, dlse=dlse, **options)
    dtype = str(q.dtype).removeprefix("torch.")
    errors = []
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, want, naive):
        assert type(got) is type(q) and got.dtype == q.dtype and got.shape == ref.shape, name
        got64, ref64, low64 = (x.double().cpu().numpy() for x in (got, ref, low))
        assert not np.isnan(got64).any(), f"{name}: unwritten (NaN-poisoned) or NaN gradient"
        err, naive_err = rel_error(got64, ref64), rel_error(low64, ref64)
        assert err <= 2 * BOUND[dtype], f"{name}: relative error {err:.2e} over {2 * BOUND[dtype]}"
        assert err <= 2 * naive_err + FLOOR[dtype], f"{name}: error {err:.2e} > 2 x naive {naive_err:.2e}"
        errors.append(err)
    return errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", FA2_BWD_HEAD_DIMS)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_backward_matches_float64_autograd(rng, dtype, head_dim, case):
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    b, nq, nk, hq, hkv, causal, window, softcap = CASES[case]
    tdtype = getattr(torch, dtype)
    q = torch.randn(b, nq, hq, head_dim, device="cuda", dtype=tdtype)
    k, v = (torch.randn(b, nk, hkv, head_dim, device="cuda", dtype=tdtype) for _ in range(2))
    check_backward(torch, q, k, v, causal=causal, window=window, softcap=softcap, scale=None, layout="bshd")


@pytest.mark.parametrize("deterministic", (False, True))
@pytest.mark.parametrize("head_dim", (8, 17, 40, 59, 80, 111, 160, 224))
@pytest.mark.parametrize("case", ["causal-gqa-odd", "window-softcap"], ids=str)
def test_backward_head_dims_below_a_tile_width(rng, head_dim, case, deterministic):
    """The next tile width's kernels with the columns past head_dim zero in shared memory (and
    never stored): multiples of 8 in 16-byte chunks, the others element by element."""
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    b, nq, nk, hq, hkv, causal, window, softcap = CASES[case]
    q = torch.randn(b, nq, hq, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_backward(torch, q, k, v, causal=causal, window=window, softcap=softcap, scale=None, layout="bshd",
                   deterministic=deterministic)  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"layout": "bhsd", "causal": True},
        {"layout": "bshd", "scale": -0.3},  # q runs negated; dq carries the sign
        {"layout": "bshd", "scale": -0.2, "softcap": 4.0},
        {"layout": "bhsd", "scale": 0.0},  # uniform P: dq = dk = 0
        {"layout": "bshd", "scale": 2.5, "causal": True, "window": (40, -1)},
    ],
    ids=str,
)
def test_backward_layouts_and_scales(rng, options):
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    opts = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    bhsd = opts["layout"] == "bhsd"
    shape = (lambda n, h: (2, h, n, 64)) if bhsd else (lambda n, h: (2, n, h, 64))
    q = torch.randn(shape(77, 4), device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape(150, 2), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if opts["scale"] == 0.0:
        dout = torch.randn_like(q)
        out, lse = cupyflash.attention(q, k, v, return_lse=True, **opts)
        dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, **opts)
        assert (dq == 0).all() and (dk == 0).all()
        want = _grads(torch, q, k, v, dout, torch.float64, **opts)[2]
        assert rel_error(dv.double().cpu().numpy(), want.cpu().numpy()) < 1e-2
        return
    check_backward(torch, q, k, v, **opts)


DETERMINISTIC_CASES = ["causal-gqa-odd", "window-softcap", "causal-mqa-nq>nk", "causal-gqa-long", "many-key-blocks",
                       "window-long"]  # fmt: skip


@pytest.mark.parametrize("head_dim", FA2_BWD_HEAD_DIMS)
@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=str)
def test_deterministic_is_bit_identical_and_right(rng, head_dim, case):
    """deterministic=True (on Hopper at d = 64 and 128: the key blocks add into each dQ tile in a
    fixed order; elsewhere dQ from the query-block kernel, no atomics): three runs give the same
    bits, and the gradients pass the same oracle checks as the default's."""
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    b, nq, nk, hq, hkv, causal, window, softcap = CASES[case]
    q = torch.randn(b, nq, hq, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = {"causal": causal, "window": window, "softcap": softcap, "scale": None, "layout": "bshd"}
    check_backward(torch, q, k, v, deterministic=True, **opts)
    dout = torch.randn_like(q)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **opts)
    runs = [cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **opts) for _ in range(3)]
    for again in runs[1:]:
        for first, other in zip(runs[0], again):
            assert torch.equal(first, other)
    default = cupyflash.attention_backward(dout, q, k, v, out, lse, **opts)
    for det, atomic in zip(runs[0], default):  # the same math, summed in another order
        assert rel_error(det.double().cpu().numpy(), atomic.double().cpu().numpy()) < 1e-2


def check_through_the_lse(rng, nq, nk, hq, hkv, causal):
    """A float16 backward (B = 2, d = 128) with a loss through the LSE too, against the float64
    oracle; returns torch and the inputs."""
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    q = torch.randn(2, nq, hq, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, nk, hkv, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    dlse = torch.randn(2, hq, nq, device="cuda")
    opts = {"causal": causal, "window": (-1, -1), "softcap": 0.0, "scale": None, "layout": "bshd"}
    check_backward(torch, q, k, v, dlse=dlse, **opts)
    return torch, q, k, v


def test_loss_through_the_lse(rng):
    check_through_the_lse(rng, 100, 130, 4, 4, causal=True)


def test_strided_inputs_and_cupy_arrays(rng):
    """Views the kernels cannot read (a stride on d) are copied; CuPy in, CuPy out."""
    torch = need_torch()
    import cupy

    torch.manual_seed(int(rng.integers(1 << 31)))
    base = torch.randn(1, 90, 2, 2 * 64, device="cuda", dtype=torch.bfloat16)
    q = base[..., ::2]  # stride 2 on head_dim
    k, v = (torch.randn(1, 90, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = {"causal": True, "window": (-1, -1), "softcap": 0.0, "scale": None, "layout": "bshd"}
    check_backward(torch, q, k, v, **opts)

    cq, ck, cv = (
        cupy.asarray(rng.standard_normal((1, 70, 2, 32)).astype(np.float32)).astype("float16") for _ in range(3)
    )
    dout = cupy.asarray(rng.standard_normal(cq.shape).astype(np.float32)).astype("float16")
    out, lse = cupyflash.attention(cq, ck, cv, causal=True, return_lse=True)
    grads = cupyflash.attention_backward(dout, cq, ck, cv, out, lse, causal=True)
    tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (cq, ck, cv, dout))
    want = _grads(torch, tq, tk, tv, tdo, torch.float64, causal=True, window=(-1, -1), softcap=0.0, scale=None,
                  layout="bshd")  # fmt: skip
    for got, ref in zip(grads, want):
        assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float16
        assert rel_error(cupy.asnumpy(got).astype(np.float64), ref.cpu().numpy()) < 2 * BOUND["float16"]


@pytest.fixture
def decoupled_backward(monkeypatch):
    """Switches the Hopper backward's consumers meeting once a step (Fa3BwdSpec.decoupled) on or
    off for the test's calls, everywhere (off: the causal d = 128 default too); the plans made
    under either setting are dropped before and after."""
    from cupyflash import _dispatch, _plan

    def switch(on: bool) -> None:
        if on and not is_hopper():
            pytest.skip("the decoupled consumers are a Hopper backward variant")
        monkeypatch.setattr(_dispatch, "FA3_BWD_DECOUPLED", on)
        monkeypatch.setattr(_dispatch, "FA3_BWD_DECOUPLED_CAUSAL", on)
        _plan.clear_caches()

    yield switch
    _plan.clear_caches()


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("case", ["causal-gqa-long", "many-key-blocks", "window-softcap", "half-step"], ids=str)
def test_decoupled_consumers_match_float64_autograd(rng, head_dim, case, decoupled_backward):
    """The Hopper backward with its consumers a step apart at most (dS^T in two buffers, dQ's
    parts handed to the writer warp per consumer): the same gradients as the float64 oracle's,
    and bit-identical dK and dV over three runs (their sums stay in registers; dQ's adds are in
    no fixed order)."""
    decoupled_backward(True)
    check_variant_backward(need_torch(), rng, head_dim, case)


def check_variant_backward(torch, rng, head_dim, case, deterministic_too=False):
    """A Hopper backward variant on CASES[case] (or ROWS80_CASES[case]), bf16: its gradients
    against the float64 oracle's (and the fixed order's too), and dK and dV bit-identical over
    three runs (their sums stay in registers; dQ's adds are in no fixed order)."""
    torch.manual_seed(int(rng.integers(1 << 31)))
    b, nq, nk, hq, hkv, causal, window, softcap = CASES[case] if case in CASES else ROWS80_CASES[case]
    q = torch.randn(b, nq, hq, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = {"causal": causal, "window": window, "softcap": softcap, "scale": None, "layout": "bshd"}
    check_backward(torch, q, k, v, **opts)
    if deterministic_too:
        check_backward(torch, q, k, v, deterministic=True, **opts)
    dout = torch.randn_like(q)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **opts)
    runs = [cupyflash.attention_backward(dout, q, k, v, out, lse, **opts) for _ in range(3)]
    for dq, dk, dv in runs[1:]:
        assert torch.equal(dk, runs[0][1]) and torch.equal(dv, runs[0][2])
        assert torch.allclose(dq, runs[0][0], rtol=1e-2, atol=1e-2)


# The 80-row steps' own cases (no causal mask, window or softcap, where they apply): a GQA group
# of 8 over 13 steps of 80 rows each (the last 40: padding rows), whole steps, one query row.
ROWS80_CASES = {
    "rows80-gqa-long": (1, 1000, 1000, 8, 1, False, (-1, -1), 0.0),
    "rows80-whole-steps": (2, 160, 333, 4, 2, False, (-1, -1), 0.0),
    "rows80-one-query": (2, 1, 200, 4, 4, False, (-1, -1), 0.0),
}


@pytest.fixture
def rows80_backward(monkeypatch):
    """The d = 128 Hopper backward with 80-row steps (_dispatch.FA3_BWD_ROWS80) for the test's
    calls, checked to be what the dispatcher picks; the plans made under it dropped before and
    after."""
    from cupyflash import _dispatch, _plan

    if not is_hopper():
        pytest.skip("a Hopper backward variant")
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS80", True)
    _plan.clear_caches()
    assert _dispatch.fa3_bwd_spec("bfloat16", 128, _dispatch.MaskFlags(False, False, False), False, False).rows80
    yield
    _plan.clear_caches()


@pytest.mark.parametrize("case", ["square", "one-query", "many-key-blocks", *ROWS80_CASES], ids=str)
def test_80_row_steps_match_float64_autograd(rng, case, rows80_backward):
    """The d = 128 Hopper backward in 80-row steps (S^T, dP^T m64n80; dQ^T = K^T dS^T into the
    swapped dQacc tiles, converted by dq's swapped path): the float64 oracle's gradients (the
    fixed order's 64-row steps too), dK and dV bit-identical over three runs."""
    check_variant_backward(need_torch(), rng, 128, case, deterministic_too=True)


def test_80_row_steps_in_float16_through_the_lse_and_with_nan(rng, rows80_backward):
    """The 80-row steps in float16 with a loss through the LSE (D less dLSE), and NaN in one
    head's key: that head's dQ NaN on every row, the other head's finite."""
    torch, q, k, v = check_through_the_lse(rng, 250, 190, 4, 2, causal=False)
    k[0, 5, 0, 3] = float("nan")
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dq, dk, _ = cupyflash.attention_backward(torch.ones_like(out), q, k, v, out, lse)
    assert torch.isnan(dq[0, :, :2]).all() and torch.isnan(dk[0, :, 0]).any()  # KV head 0: query heads 0, 1
    assert not torch.isnan(dq[0, :, 2:]).any() and not torch.isnan(dq[1]).any()


@pytest.fixture
def producer_rows_backward(monkeypatch):
    """The Hopper backward with each step's -LSE log2 e and D copied by its producer
    (_dispatch.FA3_BWD_ROWS_BY_PRODUCER) for the test's calls, checked to be what the dispatcher
    picks; the plans made under it dropped before and after."""
    from cupyflash import _dispatch, _plan

    if not is_hopper():
        pytest.skip("a Hopper backward variant")
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS_BY_PRODUCER", True)
    _plan.clear_caches()
    causal = _dispatch.MaskFlags(True, False, False)
    assert _dispatch.fa3_bwd_spec("bfloat16", 64, causal, False, False).rows_by_producer
    yield
    _plan.clear_caches()


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("case", [*CASES, *ROWS80_CASES], ids=str)
def test_producer_loaded_rows_match_float64_autograd(rng, head_dim, case, producer_rows_backward):
    """The Hopper backward with each step's -LSE log2 e and D copied whole by its producer (a
    padding row's -inf and 0 written by prep, read as they are): the float64 oracle's gradients,
    the fixed order's too, dK and dV bit-identical over three runs (the 80-row steps at d = 128
    without a mask)."""
    check_variant_backward(need_torch(), rng, head_dim, case, deterministic_too=True)


@pytest.mark.parametrize("case", ["many-key-blocks", *ROWS80_CASES], ids=str)
def test_decoupled_80_row_steps_match_float64_autograd(rng, case, decoupled_backward, producer_rows_backward):
    """The decoupled consumers in 80-row steps (d = 128 without a mask; with the producer's rows,
    whose one copy makes room for the second dS buffer): each consumer's contiguous half of the
    swapped dQ tile added by the writer warp as it is staged; the float64 oracle's gradients, dK
    and dV bit-identical over three runs."""
    from cupyflash import _dispatch

    decoupled_backward(True)
    spec = _dispatch.fa3_bwd_spec("bfloat16", 128, _dispatch.MaskFlags(False, False, False), False, False)
    assert spec.decoupled and spec.rows80 == _dispatch.FA3_BWD_ROWS80 and spec.rows_by_producer
    check_variant_backward(need_torch(), rng, 128, case, deterministic_too=True)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_producer_loaded_rows_over_packed_sequences(rng, head_dim, monkeypatch, decoupled_backward,
                                                    producer_rows_backward):  # fmt: skip
    """test_varlen_backward with the producer's copies of the rows: each sequence's aligned
    temporaries read whole, the rows past its end (padding, -inf and 0) among them."""
    test_varlen_backward(rng, "bfloat16", head_dim, False, False, monkeypatch, decoupled_backward)


@pytest.fixture
def backward_order(monkeypatch):
    """Sets the Hopper backward's step order for the test's calls: the exponentials under dP^T
    (``_dispatch.FA3_BWD_LATE_EXP`` off) and, with ``dq_first``, dK issued after dQ; the plans
    made under either setting are dropped before and after."""
    from cupyflash import _dispatch, _plan

    def switch(dq_first: bool) -> None:
        if not is_hopper():
            pytest.skip("a Hopper backward variant")
        monkeypatch.setattr(_dispatch, "FA3_BWD_LATE_EXP", False)
        monkeypatch.setattr(_dispatch, "FA3_BWD_DQ_FIRST", dq_first)
        _plan.clear_caches()

    yield switch
    _plan.clear_caches()


@pytest.mark.parametrize("dq_first", [False, True], ids=["exp-under-dp", "dq-first"])
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("case", ["causal-gqa-odd", "causal-gqa-long", "many-key-blocks", "window-both"], ids=str)
def test_exponentials_under_dp_match_float64_autograd(rng, head_dim, case, dq_first, backward_order):
    """The Hopper backward with P^T formed and dV issued while dP^T is on the tensor cores (and
    dK after dQ): the same gradients as the float64 oracle's, and bit-identical dK and dV over
    three runs (their sums stay in registers)."""
    if dq_first and head_dim != 128:
        pytest.skip("dK after dQ is a d = 128 variant")
    backward_order(dq_first)
    check_variant_backward(need_torch(), rng, head_dim, case, deterministic_too=True)


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("case", ["causal-lpt-sections", "causal-gqa-odd", "causal-mqa-nq>nk"], ids=str)
def test_causal_ctas_longest_first_in_sections_match_float64_autograd(rng, head_dim, case, monkeypatch):
    """The causal Hopper backward with its CTAs in sections of (batch, KV head) pairs, each key
    block first (_dispatch.FA3_BWD_LPT; at most 4 pairs a section, so 7 pairs make sections of 4
    and 3): every CTA's key block and pair taken once (a lost or doubled one would leave dK and dV
    rows unwritten or wrong), the gradients the float64 oracle's, dK and dV bit-identical over
    three runs."""
    from cupyflash import _dispatch, _plan

    if not is_hopper():
        pytest.skip("a Hopper backward variant")
    b, nq, nk, hq, hkv, *_ = CASES[case]
    monkeypatch.setattr(_dispatch, "FA3_BWD_LPT", True)
    monkeypatch.setattr(_dispatch, "FA3_BWD_LPT_L2_BYTES", 4 * nq * (hq // hkv) * (head_dim * 8 + 8))
    _plan.clear_caches()
    try:
        check_variant_backward(need_torch(), rng, head_dim, case, deterministic_too=True)
    finally:
        _plan.clear_caches()


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_varlen_backward(rng, dtype, head_dim, deterministic, decoupled, monkeypatch, decoupled_backward):
    """Packed sequences, an empty and a one-token one among them, rows after the last sequence:
    each sequence's gradients as the dense oracle's (every row written: outputs poisoned), zero
    gradients outside every sequence (written by the packed fill step: under the poison, and
    again unpoisoned). Decoupled: the Hopper backward's consumers a step apart (default order)."""
    torch = need_torch()
    from cupyflash import _launch

    if decoupled and deterministic:
        pytest.skip("the decoupled consumers take the default order")
    decoupled_backward(decoupled)

    torch.manual_seed(int(rng.integers(1 << 31)))
    tdtype = getattr(torch, dtype)
    lens_q, lens_k = [70, 0, 1, 129, 33], [90, 17, 1, 129, 200]
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(x)], dtype=torch.int32, device="cuda") for x in (lens_q, lens_k))
    total_q, total_k = int(cu_q[-1]) + 3, int(cu_k[-1]) + 5
    q = torch.randn(total_q, 4, head_dim, device="cuda", dtype=tdtype)
    k, v = (torch.randn(total_k, 2, head_dim, device="cuda", dtype=tdtype) for _ in range(2))
    dout = torch.randn_like(q)
    opts = {"causal": True, "window": (-1, -1), "softcap": 0.0, "scale": None}
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 129, 200, return_lse=True, **opts)
    dq, dk, dv = cupyflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, 129, 200, deterministic=deterministic, **opts
    )
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:  # keys no query sees: written as zeros by the kernel
            assert (dk[rk] == 0).all() and (dv[rk] == 0).all()
            continue
        want = _grads(
            torch, q[None, rq], k[None, rk], v[None, rk], dout[None, rq], torch.float64, layout="bshd", **opts
        )
        for name, got, ref in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), want):
            assert not torch.isnan(got).any(), f"sequence {b} {name}: unwritten (NaN-poisoned) rows"
            # relative to ||ref||, floored at 1: one query over one key has dq = 0 exactly (P = 1)
            got64, ref64 = got.double().cpu().numpy(), ref[0].cpu().numpy()
            err = float(np.linalg.norm(got64 - ref64) / max(np.linalg.norm(ref64), 1.0))
            assert err < 2 * BOUND[dtype], f"sequence {b} {name}: {err:.2e}"
    # Rows outside every sequence: zero gradients, written by the packed launches' first step
    # (kernels_cu/packed_fill.cu; the forward's LSE -inf there), under the poison above too
    assert (dq[int(cu_q[-1]) :] == 0).all() and bool(torch.isneginf(lse[:, int(cu_q[-1]) :]).all())
    assert (dk[int(cu_k[-1]) :] == 0).all() and (dv[int(cu_k[-1]) :] == 0).all()
    monkeypatch.setattr(_launch, "POISON_OUTPUTS", False)
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 129, 200, return_lse=True, **opts)
    dq, dk, dv = cupyflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, 129, 200, deterministic=deterministic, **opts
    )
    assert (dq[int(cu_q[-1]) :] == 0).all()
    assert (dk[int(cu_k[-1]) :] == 0).all() and (dv[int(cu_k[-1]) :] == 0).all()


# (causal, window, softcap, ALiBi) of packed sequences: every option the Hopper backward takes
VARLEN_OPTIONS = {
    "plain": (False, (-1, -1), 0.0, False),
    "window": (False, (40, 7), 0.0, False),
    "causal-softcap": (True, (-1, -1), 5.0, False),
    "causal-window-alibi": (True, (100, -1), 0.0, True),
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("case", VARLEN_OPTIONS)
def test_varlen_backward_options_and_neighbours(rng, case, head_dim, deterministic):
    """Packed sequences (lengths at, under and over the 64- and 128-row blocks, empty and
    one-token ones) under each option, one sequence's q, k, v and dout holding NaN: every other
    sequence's gradients as the dense oracle's. A block that runs past a sequence's end reads its
    neighbour's rows (on Hopper TMA reads them whole); those take no part, NaN or not."""
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    causal, window, softcap, alibi = VARLEN_OPTIONS[case]
    lens_q, lens_k = [64, 1, 130, 0, 77, 128], [64, 200, 1, 5, 300, 129]
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(x)], dtype=torch.int32, device="cuda") for x in (lens_q, lens_k))
    q = torch.randn(int(cu_q[-1]), 4, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    poisoned = 2  # the neighbour of sequence 1 (one query, 200 keys) and 3 (no query)
    for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k), (dout, cu_q)):
        x[int(cu[poisoned]) : int(cu[poisoned + 1])] = float("nan")
    slopes = torch.rand(4, device="cuda", dtype=torch.float32) if alibi else None
    opts = {"causal": causal, "window": window, "softcap": softcap, "scale": None}
    out, lse = cupyflash.attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, alibi_slopes=slopes, **opts
    )
    dq, dk, dv = cupyflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), deterministic=deterministic,
        alibi_slopes=slopes, **opts,
    )  # fmt: skip
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if b == poisoned:
            continue
        if lens_q[b] == 0:  # keys no query sees
            assert (dk[rk] == 0).all() and (dv[rk] == 0).all(), f"sequence {b}"
            continue
        want = _grads(torch, q[None, rq], k[None, rk], v[None, rk], dout[None, rq], torch.float64, layout="bshd",
                      alibi_slopes=slopes, **opts)  # fmt: skip
        for name, got, ref in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), want):
            assert not torch.isnan(got).any(), f"sequence {b} {name}: NaN (unwritten, or its neighbour's)"
            got64, ref64 = got.double().cpu().numpy(), ref[0].cpu().numpy()
            err = float(np.linalg.norm(got64 - ref64) / max(np.linalg.norm(ref64), 1.0))
            assert err < 2 * BOUND["bfloat16"], f"sequence {b} {name}: {err:.2e}"


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_backward_reports_a_sequence_longer_than_max_seqlen_k(deterministic):
    """On Hopper the packed backward's key blocks cover max_seqlen_k keys: a sequence with more
    is reported by check_device_errors, not left with zero dK and dV in silence (and the
    deterministic mode's dQ turns count only the key blocks launched: no wait for the others)."""
    torch = need_torch()
    if not is_hopper():
        pytest.skip("elsewhere the key blocks cover the packed total")
    cupyflash.check_device_errors()  # (cleared)
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in ([0, 10, 20], [0, 10, 310]))
    q = torch.randn(20, 2, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(310, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 10, 300, return_lse=True)
    det = {"deterministic": deterministic}
    cupyflash.attention_varlen_backward(torch.ones_like(q), q, k, v, out, lse, cu_q, cu_k, 10, 300, **det)
    cupyflash.check_device_errors()  # keys within the maximum: nothing to report
    cupyflash.attention_varlen_backward(torch.ones_like(q), q, k, v, out, lse, cu_q, cu_k, 10, 100, **det)
    with pytest.raises(cupyflash.DeviceValueError, match="more keys than max_seqlen_k"):
        cupyflash.check_device_errors()


def test_varlen_backward_with_overlapping_sequences_returns_and_reports():
    """Decreasing cu_seqlens_q can give two sequences one dQ tile (their per-row temporaries
    overlap): the deterministic mode, whose key blocks take turns per tile, must still return,
    and check_device_errors names the offsets."""
    torch = need_torch()
    cupyflash.check_device_errors()  # (cleared)
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in ([0, 300, 100, 400], [0, 300, 600, 900]))
    q = torch.randn(400, 2, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(900, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 300, 300, return_lse=True)
    grads = cupyflash.attention_varlen_backward(
        torch.ones_like(q), q, k, v, out, lse, cu_q, cu_k, 300, 300, deterministic=True
    )
    torch.cuda.synchronize()
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with pytest.raises(cupyflash.DeviceValueError, match="cu_seqlens_q value"):
        cupyflash.check_device_errors()


def test_nan_in_gives_nan_out(rng):
    torch = need_torch()
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    k[0, 5, 0, 3] = float("nan")
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cupyflash.attention_backward(torch.ones_like(out), q, k, v, out, lse)
    assert torch.isnan(dq[:, :, 0]).all() and torch.isnan(dk[:, :, 0]).any()
    assert not torch.isnan(dq[:, :, 1]).any() and not torch.isnan(dk[:, :, 1]).any()  # the other head


def test_refusals_name_the_problem():
    torch = need_torch()
    q = torch.randn(1, 8, 1, 264, device="cuda", dtype=torch.float16)  # above every tile width
    lse = torch.zeros(1, 1, 8, device="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        cupyflash.attention_backward(q, q, q, q, q, lse)
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
    out, lse = cupyflash.attention(q, q, q, return_lse=True)
    with pytest.raises(TypeError, match="lse must be float32"):
        cupyflash.attention_backward(out, q, q, q, out, lse.half())
    with pytest.raises(ValueError, match="dout must have shape"):
        cupyflash.attention_backward(out[:, :4], q, q, q, out, lse)
