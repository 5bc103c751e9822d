"""The FP8 forward's host side: the host path (e4m3 inputs dequantised, exact attention) against the
float64 reference of the dequantised inputs, the descale forms, the refusals, and its plan and
kernel variants (the GPU kernels: tests/test_gpu_fp8_forward.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import _device, _dispatch, _plan, reference
from cupyflash._specs import FP8_FWD_HEAD_DIMS, Fa3FwdSpec, Fp8VtSpec
from cupyflash._validate import attention_problem

E4M3 = ml_dtypes.float8_e4m3fn


def _inputs(rng, b=2, nq=37, nk=41, hq=4, hkv=2, d=32, layout="bshd"):
    def make(n, h):
        shape = (b, n, h, d) if layout == "bshd" else (b, h, n, d)
        return (rng.standard_normal(shape) * 2).astype(E4M3)

    return make(nq, hq), make(nk, hkv), make(nk, hkv)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True])
def test_host_fp8_matches_reference_of_dequantised_inputs(rng, causal, layout):
    b, hkv = 2, 2
    q, k, v = _inputs(rng, b=b, hkv=hkv, layout=layout)
    k_descale = (rng.random((b, hkv)) + 0.5).astype(np.float32)
    out, lse = cupyflash.attention(
        q, k, v, causal=causal, layout=layout, return_lse=True, q_descale=0.5, k_descale=k_descale,
        v_descale=np.array(2.0, np.float32),
    )  # fmt: skip
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == q.shape and lse.dtype == np.float32
    kd = k_descale[:, None, :, None] if layout == "bshd" else k_descale[:, :, None, None]
    want, want_lse = reference.attention(
        q.astype(np.float64) * 0.5, k.astype(np.float64) * kd, v.astype(np.float64) * 2.0, causal=causal,
        layout=layout, return_lse=True,
    )  # fmt: skip
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2**-7, atol=2**-7 * np.abs(want).max())
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_host_fp8_descale_forms_and_out_dtype(rng):
    q, k, v = _inputs(rng)
    forms = [0.25, np.float32(0.25), np.array(0.25, np.float32), np.full((2,), 0.25, np.float32),
             np.full((2, 2), 0.25, np.float32)]  # fmt: skip
    outs = [cupyflash.attention(q, k, v, q_descale=f, k_descale=f, v_descale=f, out_dtype="float16") for f in forms]
    assert all(o.dtype == np.float16 for o in outs)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    bytes_out = cupyflash.attention(*(x.view(np.uint8) for x in (q, k, v)), fp8_dtype="e4m3")
    np.testing.assert_array_equal(bytes_out, cupyflash.attention(q, k, v))


def test_host_fp8_in_torch(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(rng)
    got = cupyflash.attention(*(torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q, k, v)))
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.float().numpy(), cupyflash.attention(q, k, v).astype(np.float32))
    wants_grad = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn).requires_grad_()
    tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (k, v))
    with pytest.raises(RuntimeError, match="no backward pass"):
        cupyflash.attention(wants_grad, tk, tv)
    with torch.no_grad():
        assert torch.equal(cupyflash.attention(wants_grad, tk, tv), got)


def test_fp8_forward_refusals(rng):
    q, k, v = _inputs(rng)
    cases = [
        ({"softcap": 5.0}, ValueError, "softcap"),
        ({"window": (4, 0)}, ValueError, "window"),
        ({"dropout_p": 0.1}, ValueError, "dropout_p"),
        ({"alibi_slopes": np.ones(4, np.float32)}, ValueError, "alibi_slopes"),
        ({"attn_mask": np.ones((37, 41), bool)}, ValueError, "attn_mask"),
        ({"algorithm": "fa2"}, ValueError, "algorithm"),
        ({"scale": -0.1}, ValueError, "positive scale"),
        ({"out_dtype": "float32"}, TypeError, "out_dtype"),
        ({"fp8_dtype": "e5m2"}, ValueError, "fp8_dtype"),
        ({"k_descale": np.ones(3, np.float32)}, ValueError, r"\(heads_kv,\)"),
        ({"k_descale": np.ones((2, 2), np.float64)}, TypeError, "float32"),
        ({"v_descale": -1.0}, ValueError, "positive"),
        ({"v_descale": np.array([1.0, np.nan], np.float32)}, ValueError, "positive and finite"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            cupyflash.attention(q, k, v, **kwargs)
    with pytest.raises(TypeError, match="fp8_dtype='e4m3'"):
        cupyflash.attention(*(x.view(np.uint8) for x in (q, k, v)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        cupyflash.attention(q, k.astype(np.float32), v)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        cupyflash.attention(q.astype(ml_dtypes.float8_e5m2), k, v)
    with pytest.raises(TypeError, match="descales and fp8_dtype are for float8 inputs"):
        cupyflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), q_descale=2.0)
    with pytest.raises(TypeError, match="real floating dtype, got int8"):  # the usual dtype error
        cupyflash.attention(q.view(np.int8), k.view(np.int8), v.view(np.int8))
    with pytest.raises(TypeError, match="out_dtype is the FP8 forward's"):
        cupyflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), out_dtype="bfloat16")


def test_fp8_variants_and_plan():
    """The FP8 forward's kernels: V's transpose and the Hopper kernel on E4m3Inputs, shared memory
    counted with 1-byte Q, K, V and a 16-bit O; the plan's two Launches."""
    specs = _dispatch.all_fp8_fwd_specs()
    assert {s.head_dim for s in specs} == set(FP8_FWD_HEAD_DIMS) and specs[0] == Fp8VtSpec(128)
    main = [s for s in specs if isinstance(s, Fa3FwdSpec)]
    assert len(main) == 4 and all(s.fp8 and "_e4m3_" in s.name for s in main)
    assert "E4m3Inputs<__nv_bfloat16>" in main[-1].template_args()
    s = main[0]
    assert s.smem_bytes == 1024 + 128 * (2 * 128 + 2 * 2 * 128) + 2 * 128 * 128 + 8 * (4 + 8) + 8
    with pytest.raises(ValueError, match="FP8 forward"):
        Fa3FwdSpec("bfloat16", 64, s.tile, fp8=True)
    p = attention_problem((2, 4, 77, 128), (2, 2, 300, 128), (2, 2, 300, 128), causal=True, scale=None,
                          window=(-1, -1), softcap=0.0, layout="bhsd", dropout_p=0.0)  # fmt: skip
    device = _device.HOPPER
    forms = {"q_descale": "host", "k_descale": "batch_head", "v_descale": "head"}
    transpose, attention = _plan.plan_fp8_forward(p, "float16", device, (2, 4, 77, 128), forms)
    assert transpose.outputs[0].shape == (2, 2, 128, 384) and transpose.steps[0].grid == (3, 2, 2)
    assert attention.steps[0].tma.maps[2] == ("v", (384, 128, 2, 2), 128)
    values, slot = attention.params.values, attention.params.slot
    assert (values[slot("k_descale_batch_stride")], values[slot("k_descale_head_stride")]) == (2, 1)
    assert (values[slot("v_descale_batch_stride")], values[slot("v_descale_head_stride")]) == (0, 1)
    assert values[slot("q_descale")] == 1.0


def test_quantize_qk_fp8_with_hadamard_lowers_the_error_on_outlier_channels(rng):
    """q and k with 4 of 128 channels 8x larger (the host twin's "channels" inputs): rotated
    together, the FP8 attention's RMSE against float64 of the unquantised inputs drops; without
    the rotation the pair is quantize_fp8's (q per tensor, k per head); q k^T is unchanged by it."""
    b, n, h, d = 1, 256, 2, 128
    q, k, v = (rng.standard_normal((b, n, h, d)) for _ in range(3))
    outliers = rng.choice(d, 4, replace=False)
    q[..., outliers] *= 8
    k[..., outliers] *= 8
    want = reference.attention(q, k, v)
    v8, v_scale = cupyflash.quantize_fp8(v)

    def rmse(hadamard: bool) -> float:
        q8, qs, k8, ks = cupyflash.quantize_qk_fp8(q, k, hadamard=hadamard)
        out = cupyflash.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=v_scale, out_dtype="float16")
        return float(np.sqrt(((out.astype(np.float64) - want) ** 2).mean()))

    plain, rotated = rmse(False), rmse(True)
    assert rotated * 1.5 < plain, (plain, rotated)
    q8, qs, k8, ks = cupyflash.quantize_qk_fp8(q, k)
    for got, got_scale, (want8, want_scale) in (
        (q8, qs, cupyflash.quantize_fp8(q, per="tensor")),
        (k8, ks, cupyflash.quantize_fp8(k)),
    ):
        np.testing.assert_array_equal(got.view(np.uint8), want8.view(np.uint8))
        np.testing.assert_array_equal(got_scale, want_scale)
    from cupyflash._fp8 import _hadamard_rotated

    qr, kr = _hadamard_rotated("q", q, "bshd"), _hadamard_rotated("k", k, "bshd")
    np.testing.assert_allclose(qr @ kr.transpose(0, 1, 3, 2), q @ k.transpose(0, 1, 3, 2), atol=1e-9)


def test_quantize_qk_fp8_refusals(rng):
    q = rng.standard_normal((1, 4, 2, 96))
    with pytest.raises(ValueError, match="power of two"):
        cupyflash.quantize_qk_fp8(q, q, hadamard=True)
    with pytest.raises(TypeError, match="quantize_qk_fp8 takes a PyTorch tensor or a NumPy array"):
        cupyflash.quantize_qk_fp8([1.0], q, hadamard=True)
    with pytest.raises(ValueError, match="4-d"):
        cupyflash.quantize_qk_fp8(q[0], q[0], hadamard=True)


def test_quantize_qk_fp8_in_torch(rng):
    torch = pytest.importorskip("torch")
    q, k = (torch.from_numpy(rng.standard_normal((1, 8, 2, 64))).to(torch.bfloat16) for _ in range(2))
    q8, qs, k8, ks = cupyflash.quantize_qk_fp8(q, k, hadamard=True)
    assert q8.dtype == torch.float8_e4m3fn and qs.shape == () and ks.shape == (2,)
    # the dequantised rotated pair's dot products (per token: head by head) are q k's, to e4m3's error
    got = ((q8.float() * qs) @ (k8.float() * ks[:, None]).transpose(-1, -2)).numpy()
    want = (q.float() @ k.float().transpose(-1, -2)).numpy()
    assert np.sqrt(((got - want) ** 2).mean() / (want**2).mean()) < 0.1
