"""The FP8 forward on the GPU (Hopper): e4m3 q, k, v with descale factors against the float64
reference of the dequantised inputs. Its error is bounded by that of the same reference with P
rounded to e4m3 (the one rounding the kernel adds, as FlashAttention-3's FP8 path does) and the
output rounded to its dtype. Also: V's transpose byte for byte, the LSE, NaN, the descale forms,
CuPy bytes, and the refusals. Outputs are NaN-poisoned before every launch (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import is_hopper, need_torch

import cupyflash
from cupyflash import _device, reference

pytestmark = pytest.mark.gpu


def _hopper_torch():
    torch = need_torch()
    if not is_hopper():
        pytest.skip("the FP8 forward runs on the Hopper kernel")
    return torch


def _e4m3_values(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _inputs(torch, gen, b, nq, nk, hq, hkv, d=128, layout="bshd"):
    """e4m3 q, k, v (torch, on the GPU) of spread magnitudes, and their float64 values."""

    def make(n, h, spread):
        x = torch.randn(b, n, h, d, generator=gen) * spread
        x = x if layout == "bshd" else x.transpose(1, 2).contiguous()
        return x.to(torch.float8_e4m3fn).cuda()

    q, k, v = make(nq, hq, 2.0), make(nk, hkv, 2.0), make(nk, hkv, 1.0)
    return q, k, v


def _expanded(descale: np.ndarray, b: int, h: int, hkv: int, layout: str) -> np.ndarray:
    """A (B, Hkv) descale broadcast over [B, N, H, d] (or [B, H, N, d]) of h heads."""
    per_head = np.repeat(descale, h // hkv, axis=1)
    return per_head[:, None, :, None] if layout == "bshd" else per_head[:, :, None, None]


def _rounded_p_reference(q64, k64, v64, causal, layout):
    """The float64 forward with P = exp(s - max) rounded to e4m3 before P V (l from the exact P)."""
    import ml_dtypes

    if layout == "bshd":
        q64, k64, v64 = (x.transpose(0, 2, 1, 3) for x in (q64, k64, v64))
    group = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, group, axis=1), np.repeat(v64, group, axis=1)
    s = (q64 @ k64.transpose(0, 1, 3, 2)) / np.sqrt(q64.shape[-1])
    nq, nk = s.shape[-2:]
    s = np.where(reference.visible_keys(nq, nk, causal, (-1, -1)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    p8 = p.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    out = np.where(l_sum > 0, (p8 @ v64) / np.where(l_sum > 0, l_sum, 1.0), 0.0)
    return out.transpose(0, 2, 1, 3) if layout == "bshd" else out


def _row_magnitudes(q64, k64, causal, layout):
    """Per (b, h, row): the largest scale * sum_i |q_i k_i| over the visible keys, [B, Hq, Nq]."""
    if layout == "bshd":
        q64, k64 = (x.transpose(0, 2, 1, 3) for x in (q64, k64))
    k64 = np.repeat(k64, q64.shape[1] // k64.shape[1], axis=1)
    a = (np.abs(q64) @ np.abs(k64).transpose(0, 1, 3, 2)) / np.sqrt(q64.shape[-1])
    nq, nk = a.shape[-2:]
    return np.where(reference.visible_keys(nq, nk, causal, (-1, -1)), a, 0.0).max(axis=-1, initial=0.0)


SHAPES = {  # (B, Nq, Nk, Hq, Hkv)
    "one-token": (2, 1, 1, 2, 2),
    "odd-gqa": (2, 77, 77, 4, 2),
    "long-mqa": (1, 1000, 1003, 4, 1),
    "nq<nk": (2, 130, 1030, 2, 2),
    "nq>nk": (1, 600, 257, 2, 2),
    "2k": (1, 2048, 2048, 2, 2),
}


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_fp8_forward_matches_reference_of_dequantised_inputs(rng, shape, causal, out_dtype, layout):
    torch = _hopper_torch()
    b, nq, nk, hq, hkv = SHAPES[shape]
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _inputs(torch, gen, b, nq, nk, hq, hkv, layout=layout)
    # One form each: a per-(batch, KV head) array, one host number, one array value.
    k_descale = (torch.rand(b, hkv, generator=gen) * 0.5 + 0.25).cuda()
    q_descale, v_descale = 0.75, torch.tensor(1.5, device="cuda")
    out, lse = cupyflash.attention(
        q, k, v, causal=causal, layout=layout, return_lse=True, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale, out_dtype=out_dtype,
    )  # fmt: skip
    assert out.dtype == getattr(torch, out_dtype) and tuple(out.shape) == tuple(q.shape)
    assert tuple(lse.shape) == (b, hq, nq) and lse.dtype == torch.float32
    kd = k_descale.cpu().double().numpy()
    q64 = reference.to_numpy64(q) * q_descale
    k64 = reference.to_numpy64(k) * _expanded(kd, b, hkv, hkv, layout)
    v64 = reference.to_numpy64(v) * 1.5
    ref, ref_lse = reference.attention(q64, k64, v64, causal=causal, layout=layout, return_lse=True)
    rounded = _rounded_p_reference(q64, k64, v64, causal, layout)
    got = reference.to_numpy64(out)
    assert np.isfinite(got).all()
    # the kernel's error against the bound: P's rounding (the e4m3 reference's error; the kernel
    # rounds against its running maximum, so the bound holds in RMS and at the maximum, not element
    # by element) and the output's rounding
    eps = 2.0**-8 if out_dtype == "bfloat16" else 2.0**-11
    err, err_rounded = np.abs(got - ref), np.abs(rounded - ref)
    rms = np.sqrt((ref**2).mean())
    rmse, rmse_rounded = np.sqrt((err**2).mean()), np.sqrt((err_rounded**2).mean())
    assert rmse <= 1.5 * rmse_rounded + eps * rms, (rmse, rmse_rounded, rms)
    assert err.max() <= 2.0 * err_rounded.max() + eps * np.abs(ref).max() + 1e-3, (err.max(), err_rounded.max())
    # The LSE adds float32 P, but the scores come from the tensor cores' FP8 products, whose sums
    # keep fewer mantissa bits than float32 (about 13 on Hopper): the bound is 2^-11 of the row's
    # largest scale * sum_i |q_i k_i|.
    visible = np.isfinite(ref_lse)
    magnitude = _row_magnitudes(q64, k64, causal, layout)
    lse_err = np.abs(reference.to_numpy64(lse)[visible] - ref_lse[visible])
    assert (lse_err <= 2.0**-11 * magnitude[visible] + 1e-5).all(), (lse_err.max(), magnitude[visible].max())


def test_fp8_forward_descale_forms_agree(rng):
    """The same factors as a host number, a 0-d array, a (Hkv,) array and a (B, Hkv) array give
    the same output, bit for bit."""
    torch = _hopper_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, hkv = 2, 2
    q, k, v = _inputs(torch, gen, b, 300, 300, 4, hkv)
    forms = [0.5, torch.tensor(0.5, device="cuda"), torch.full((hkv,), 0.5, device="cuda"),
             torch.full((b, hkv), 0.5, device="cuda")]  # fmt: skip
    outs = [cupyflash.attention(q, k, v, q_descale=f, k_descale=f, v_descale=f) for f in forms]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    plain = cupyflash.attention(q, k, v)
    assert not torch.equal(plain, outs[0])  # the factors do act


def test_fp8_vt_is_v_transposed_with_permuted_keys(rng):
    """fp8_vt.cu's output: Vt[b, c, h, j] = V[b, key(j), h, c] with key(j) fp8_vt_key's order inside
    every 32, zeros past the last key (bshd: d on the rows' axis)."""
    torch = _hopper_torch()
    from cupyflash import _fp8_forward, _interop, _launch, _plan
    from cupyflash._validate import attention_problem

    b, nk, hkv, d = 2, 333, 3, 128
    v = torch.randint(0, 255, (b, nk, hkv, d), dtype=torch.uint8, device="cuda")
    v[v == 0x7F] = 1  # no NaN bytes: the poison is 0x7F
    p = attention_problem((b, 5, hkv, d), (b, nk, hkv, d), (b, nk, hkv, d), causal=False, scale=None,
                          window=(-1, -1), softcap=0.0, layout="bshd", dropout_p=0.0)  # fmt: skip
    transpose, _ = _plan.plan_fp8_forward(p, "bfloat16", _device.device_info(0), (b, 5, hkv, d), {})
    (vt,) = _launch.run_outputs(transpose, _interop.TORCH_LIB, 0, {"v": v})
    keys = vt.shape[-1]
    assert keys == 384 and tuple(vt.shape) == (b, d, hkv, keys)
    c = np.arange(32)
    order = 16 * (c // 16) + 8 * ((c % 4) // 2) + 2 * ((c % 16) // 4) + c % 2
    assert sorted(order) == list(range(32))
    key_of = 32 * (np.arange(keys) // 32) + order[np.arange(keys) % 32]
    want = np.zeros((b, d, hkv, keys), np.uint8)
    vn = v.cpu().numpy()
    valid = key_of < nk
    want[..., valid] = vn[:, key_of[valid]].transpose(0, 3, 2, 1)
    np.testing.assert_array_equal(vt.cpu().numpy(), want)
    assert _fp8_forward.DESCALE_NAMES == ("q_descale", "k_descale", "v_descale")


def test_fp8_forward_nan_stays_in_its_row(rng):
    torch = _hopper_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _inputs(torch, gen, 1, 200, 200, 2, 2)
    q = q.view(torch.uint8).clone()
    q[0, 17, 1, 5] = 0x7F  # e4m3 NaN
    out = cupyflash.attention(q.view(torch.float8_e4m3fn), k, v)
    bad = torch.isnan(out.float())
    assert bad[0, 17, 1].all() and int(bad.sum()) == 128


def test_fp8_forward_takes_cupy_bytes(rng):
    torch = _hopper_torch()
    import cupy

    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _inputs(torch, gen, 2, 129, 129, 2, 2)
    want = cupyflash.attention(q, k, v, causal=True)
    as_bytes = [cupy.from_dlpack(x.view(torch.uint8)) for x in (q, k, v)]
    got = cupyflash.attention(*as_bytes, causal=True, fp8_dtype="e4m3")
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(
        cupy.asnumpy(got.view(cupy.uint16)), want.view(torch.int16).cpu().numpy().view(np.uint16)
    )
    with pytest.raises(TypeError, match="fp8_dtype='e4m3'"):
        cupyflash.attention(*as_bytes)


def test_fp8_forward_refusals(rng):
    torch = _hopper_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _inputs(torch, gen, 1, 64, 64, 2, 2)
    with pytest.raises(ValueError, match="head_dim"):
        cupyflash.attention(*_inputs(torch, gen, 1, 64, 64, 2, 2, d=64))
    with pytest.raises(ValueError, match="softcap"):
        cupyflash.attention(q, k, v, softcap=10.0)
    with pytest.raises(ValueError, match="window"):
        cupyflash.attention(q, k, v, window=(8, 0))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        cupyflash.attention(q, k.to(torch.bfloat16), v)
    with pytest.raises(ValueError, match="shape"):
        cupyflash.attention(q, k, v, k_descale=torch.ones(3, device="cuda"))
    with pytest.raises(TypeError, match="float32"):
        cupyflash.attention(q, k, v, k_descale=torch.ones(2, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="positive"):
        cupyflash.attention(q, k, v, v_descale=-1.0)
    with pytest.raises(TypeError, match="out_dtype"):
        cupyflash.attention(q, k, v, out_dtype="float32")


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_empty_shapes(rng, causal):
    """No key: O = 0 and LSE = -inf; no query or no batch: empty outputs; no kernel reads past them."""
    torch = _hopper_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _inputs(torch, gen, 2, 5, 0, 2, 2)
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out.float(), torch.zeros_like(out, dtype=torch.float32)) and bool(torch.isneginf(lse).all())
    for b, nq in ((0, 5), (2, 0)):
        q, k, v = _inputs(torch, gen, b, nq, 7, 2, 2)
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
        assert tuple(out.shape) == tuple(q.shape) and tuple(lse.shape) == (b, 2, nq)


def test_fp8_forward_unusable_device_descale_gives_nan_rows(rng):
    """A device descale is not read on the host: 0, a negative or a NaN value makes its (batch,
    KV head)'s rows NaN (0 would be a uniform softmax, a plausible answer), the others untouched."""
    torch = _hopper_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, hq, hkv = 2, 4, 2
    q, k, v = _inputs(torch, gen, b, 150, 150, hq, hkv)
    want = cupyflash.attention(q, k, v).float()
    for bad in (0.0, -1.0, float("nan")):
        for name in ("k_descale", "v_descale"):
            descale = torch.ones(b, hkv, device="cuda")
            descale[1, 0] = bad
            out, lse = cupyflash.attention(q, k, v, return_lse=True, **{name: descale})
            out = out.float()
            assert torch.isnan(out[1, :, :2]).all() and torch.isnan(lse[1, :2]).all()  # KV head 0's query heads
            assert torch.equal(out[0], want[0]) and torch.equal(out[1, :, 2:], want[1, :, 2:])
