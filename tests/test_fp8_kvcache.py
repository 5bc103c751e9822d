"""Float8 KV caches on the host (the twin of the decode kernels' dequantisation and of the
append's quantisation): the attention against the float64 reference over the dequantised caches,
the bytes an append writes against the documented rule, and the input checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import kv_reference, paginate

import cupyflash
from cupyflash import _device, _fp8, _plan
from cupyflash._validate import kvcache_problem

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _quantise(x, fmt, scale):
    """The rule, spelled out independently of _fp8: round(float32(x) / scale) to the nearest
    float8 value (ml_dtypes: ties to even), saturated at the format's largest finite value."""
    info = ml_dtypes.finfo(FP8[fmt])
    quotient = x.astype(np.float32) / scale.astype(np.float32)
    return np.clip(quotient, -float(info.max), float(info.max)).astype(FP8[fmt])


def _scales(rng, form, hkv):
    values = rng.uniform(0.02, 0.2, size=hkv).astype(np.float32)
    return {"float": float(values[0]), "tensor": values[:1].reshape(()), "tensor1": values[:1], "head": values}[form]


def _column(scale, hkv):
    return np.broadcast_to(np.asarray(scale, dtype=np.float64).reshape(-1), (hkv,)).reshape(hkv, 1)


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("form", ["float", "tensor", "tensor1", "head"])
@pytest.mark.parametrize("bytes_in", [False, True], ids=["float8", "uint8"])
def test_fp8_cache_matches_reference_of_dequantised_cache(rng, page_size, fmt, form, bytes_in):
    b, length, hq, hkv, d, nnew, nq = 4, 37, 6, 2, 16, 2, 3
    k_scale, v_scale = _scales(rng, form, hkv), _scales(rng, form, hkv)
    q = rng.standard_normal((b, nq, hq, d)).astype(np.float32)
    # fresh random values with the range a calibrated cache has (|x| / scale up to ~ 5 x 10, saturating some)
    raw = [rng.standard_normal((b, length, hkv, d)).astype(np.float32) for _ in "kv"]
    caches = [_quantise(x, fmt, _column(s, hkv)) for x, s in zip(raw, (k_scale, v_scale))]
    new = [(rng.standard_normal((b, nnew, hkv, d)) * 20).astype(np.float32) for _ in "kv"]
    cached = np.array([0, 1, 20, length - nnew], dtype=np.int32)  # ragged, with 0 and 1
    expected = [c.copy() for c in caches]
    for c, n, s in zip(expected, new, (k_scale, v_scale)):
        for i in range(b):
            c[i, cached[i] : cached[i] + nnew] = _quantise(n[i], fmt, _column(s, hkv))
    dev, table = caches, None
    if page_size is not None:
        dev, table = paginate(rng, [c.view(np.uint8) for c in caches], page_size)
        dev = [c.view(FP8[fmt]) for c in dev]
    dev = [c.view(np.uint8).copy() if bytes_in else c.copy() for c in dev]
    out, lse = cupyflash.attention_with_kvcache(
        q, dev[0], dev[1], cache_seqlens=cached, block_table=table, k_new=new[0], v_new=new[1], causal=True,
        k_scale=k_scale, v_scale=v_scale, kv_dtype=fmt if bytes_in else None, return_lse=True,
    )  # fmt: skip
    # the appended bytes are exactly the rule's
    for c_after, c_want in zip(dev, expected):
        got = c_after.view(np.uint8)
        for i in range(b):
            for t in range(nnew):
                pos = int(cached[i]) + t
                where = (i, pos) if table is None else (table[i, pos // page_size], pos % page_size)
                np.testing.assert_array_equal(got[where], c_want[i, pos].view(np.uint8))
    ref_k, ref_v = (c.astype(np.float64) * _column(s, hkv) for c, s in zip(expected, (k_scale, v_scale)))
    ref, ref_lse = kv_reference(q.astype(np.float64), ref_k, ref_v, cached + nnew, True)
    assert out.dtype == q.dtype and out.shape == q.shape
    # float32 arithmetic over values up to 448 x scale: the bound scales with the output's size
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-6 * max(1.0, np.abs(ref).max()))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)


def test_quantisation_rule_on_edge_values():
    """Ties to even, saturation (infinities too) and NaN, by the shared quantiser of the host path."""
    x = np.array([[[[1.0625, 1.1875, 460.0, 1e6, np.inf, -np.inf, np.nan, 3 * 2.0**-11]]]], dtype=np.float32)
    one = np.ones((1, 1), dtype=np.float64)
    e4m3 = _fp8.quantise(np, x, "e4m3", one, np.zeros(1, FP8["e4m3"])).view(np.uint8).ravel()
    assert [int(v) for v in e4m3[:6]] == [0x38, 0x3A, 0x7E, 0x7E, 0x7E, 0xFE] and e4m3[6] & 0x7F == 0x7F
    assert e4m3[7] == 0x01  # 0.75 x the smallest subnormal rounds up to it
    e5m2 = _fp8.quantise(np, x, "e5m2", one, np.zeros(1, np.uint8)).ravel()  # uint8 bytes, as the cache
    assert e5m2.dtype == np.uint8
    assert [int(v) for v in e5m2[[0, 1, 3, 4, 5]]] == [0x3C, 0x3D, 0x7B, 0x7B, 0xFB]  # saturated, not inf
    assert np.isnan(e5m2[6:7].view(FP8["e5m2"]).astype(np.float32)).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_cpu_fp8_cache_matches_numpy(rng, fmt):
    torch = pytest.importorskip("torch")
    b, length, hq, hkv, d = 2, 20, 4, 2, 8
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    caches = [_quantise(rng.standard_normal((b, length, hkv, d)), fmt, np.full((hkv, 1), 0.05)) for _ in "kv"]
    new = [(rng.standard_normal((b, 1, hkv, d)) * 30).astype(np.float32) for _ in "kv"]
    scale = np.array([0.05, 0.07], dtype=np.float32)
    seqlens = np.array([3, 19], dtype=np.int32)
    out_np = cupyflash.attention_with_kvcache(
        q, *(c.copy() for c in caches), cache_seqlens=seqlens, k_new=new[0], v_new=new[1], k_scale=scale, v_scale=0.05
    )
    dtype = getattr(torch, _fp8.DTYPE_NAMES[fmt])
    t_caches = [torch.from_numpy(c.view(np.uint8).copy()).view(dtype) for c in caches]
    out_t = cupyflash.attention_with_kvcache(
        torch.from_numpy(q), *t_caches, cache_seqlens=torch.from_numpy(seqlens), k_new=torch.from_numpy(new[0]),
        v_new=torch.from_numpy(new[1]), k_scale=torch.from_numpy(scale), v_scale=0.05,
    )  # fmt: skip
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float32
    np.testing.assert_allclose(out_t.numpy(), out_np, atol=1e-6 * max(1.0, np.abs(out_np).max()))
    # torch's own cast of the clamped quotient gives the appended bytes
    for t_cache, x, s in zip(t_caches, new, (scale[:, None], np.float32(0.05))):
        want = (torch.from_numpy(x) / torch.from_numpy(np.asarray(s))).clamp(-57344, 57344).to(dtype)
        if fmt == "e4m3":
            want = (torch.from_numpy(x) / torch.from_numpy(np.asarray(s))).clamp(-448, 448).to(dtype)
        for i, n in enumerate(seqlens):
            assert torch.equal(t_cache[i, n].view(torch.uint8), want[i, 0].view(torch.uint8))


def _case(**changes):
    rng = np.random.default_rng(1)
    b, length, hkv, d = 2, 16, 2, 8
    args = {
        "q": rng.standard_normal((b, 1, 4, d)).astype(np.float32),
        "k_cache": np.zeros((b, length, hkv, d), dtype=FP8["e4m3"]),
        "v_cache": np.zeros((b, length, hkv, d), dtype=FP8["e4m3"]),
        "cache_seqlens": np.array([1, 2], dtype=np.int32),
        "k_new": np.ones((b, 1, hkv, d), dtype=np.float32),
        "v_new": np.ones((b, 1, hkv, d), dtype=np.float32),
    }
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"kv_dtype": "fp8"}, ValueError, "kv_dtype must be one of"),
        ({"kv_dtype": "e5m2"}, ValueError, "does not match the caches' dtype"),
        (
            {"k_cache": np.zeros((2, 16, 2, 8), np.uint8), "v_cache": np.zeros((2, 16, 2, 8), np.uint8)},
            TypeError,
            "kv_dtype='e4m3'",
        ),  # fmt: skip
        ({"v_cache": np.zeros((2, 16, 2, 8), FP8["e5m2"])}, TypeError, "must have one dtype"),
        ({"k_scale": 0.0}, ValueError, "positive and finite"),
        ({"v_scale": float("nan")}, ValueError, "positive and finite"),
        ({"k_scale": 1e39}, ValueError, "positive and finite in float32"),
        ({"k_scale": True}, TypeError, "positive float"),
        ({"k_scale": np.array([1.0, -1.0], np.float32)}, ValueError, "positive and finite"),
        ({"k_scale": np.array([1.0, 1.0, 1.0], np.float32)}, ValueError, "(heads_kv,) = (2,)"),
        ({"k_scale": np.array([1.0, 1.0], np.float64)}, TypeError, "k_scale must be float32"),
        ({"q": np.zeros((2, 1, 4, 8), FP8["e4m3"])}, TypeError, "only the KV cache may be float8"),
    ],
)
def test_fp8_validation(changes, error, message):
    args = _case(**changes)
    before = [args[n].view(np.uint8).copy() for n in ("k_cache", "v_cache")]
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        cupyflash.attention_with_kvcache(q, k, v, **args)
    for cache, old in zip((k, v), before):
        np.testing.assert_array_equal(cache.view(np.uint8), old)  # nothing written


def test_scales_refused_on_a_16_bit_cache():
    args = _case(k_cache=np.zeros((2, 16, 2, 8), np.float32), v_cache=np.zeros((2, 16, 2, 8), np.float32))
    with pytest.raises(TypeError, match="k_scale / v_scale dequantise a float8 cache"):
        cupyflash.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), k_scale=2.0, **args)
    with pytest.raises(TypeError, match="is for a float8 cache"):
        cupyflash.attention_with_kvcache(
            np.zeros((1, 1, 1, 8), np.float32), np.zeros((1, 4, 1, 8), np.float32), np.zeros((1, 4, 1, 8), np.float32),
            cache_seqlens=1, kv_dtype="e4m3",
        )  # fmt: skip


H200 = _device.HOPPER


def _gpu_plan(nq=1, d=128, alibi=False, k_form="host", v_form="head"):
    kp = kvcache_problem(
        (8, nq, 32, d), (8, 4096, 8, d), (8, 4096, 8, d), cache_seqlens=0, block_table_shape=None,
        k_new_shape=(8, 1, 8, d), v_new_shape=(8, 1, 8, d), causal=True, scale=None,
    )  # fmt: skip
    if alibi:
        import dataclasses

        from cupyflash._validate import ALIBI_HEAD

        kp = dataclasses.replace(kp, attn=dataclasses.replace(kp.attn, alibi=ALIBI_HEAD))
    dtypes = {"q": "bfloat16", "k_cache": "float8_e4m3fn", "v_cache": "float8_e4m3fn", "k_new": "bfloat16",
              "v_new": "bfloat16", "cache_seqlens": "int32"}  # fmt: skip
    return _plan.plan_kvcache(kp, dtypes, H200, num_splits=0, fp8=_fp8.Fp8Cache("e5m2", k_form, v_form))


def test_fp8_plan_runs_the_quantising_append_and_the_fp8_decode_kernel():
    launch = _gpu_plan()
    append, decode = launch.steps
    assert append.spec.name == "cf_decode_append_bf16_d128_fp8"
    assert decode.spec.name == "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8"  # FP8_DECODE_TILES: 2 CTAs per SM
    # a ring of bytes, widened in registers: half the 16-bit ring at the same stages
    ring = lambda spec: spec.tile.num_warps * 2 * spec.tile.stages * spec.tile.warp_keys * 128  # noqa: E731
    assert decode.smem == decode.spec.smem_bytes >= 128 * 16 * 2 + ring(decode.spec)
    params = launch.params
    assert params.value("kv_fp8") == 2 and params.value("k_scale") == 1.0 and params.value("v_scale") == 1.0
    assert params.value("k_scale_head_stride") == 0 and params.value("v_scale_head_stride") == 1
    kinds = {op.name: op.kind for op in launch.operands}
    assert kinds["k_cache"] == kinds["v_cache"] == _plan.FP8_TILE
    assert kinds["k_scale"] == _plan.SCALAR and kinds["v_scale"] == _plan.CONTIGUOUS


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"nq": 17}, "1 to 16 query tokens and no ALiBi; this call has 17 query tokens"),
        ({"alibi": True}, "this call has ALiBi"),
        ({"d": 96}, r"takes head_dim \(64, 128\), got 96"),
        ({"d": 256}, r"takes head_dim \(64, 128\), got 256"),
    ],
)
def test_fp8_plan_refuses_what_the_kernel_does_not_take(kw, message):
    with pytest.raises(ValueError, match=message):
        _gpu_plan(**kw)


def test_fp8_cache_operand_layout_rule():
    from cupyflash import _interop

    # bytes in 16-byte chunks: strides multiples of 16 elements (a 16-bit cache's rule is 8)
    assert _interop.tile_layout_readable((2, 4, 2, 64), (512, 128, 64, 1), chunk=16)
    assert not _interop.tile_layout_readable((2, 4, 2, 8), (64, 16, 8, 1), chunk=16)
    assert _interop.tile_layout_readable((2, 4, 2, 8), (64, 16, 8, 1))


def test_the_gpu_plan_refuses_a_host_float_scale_on_a_16_bit_cache():
    """The GPU plan sees a host float scale as the caller gave it (the kernel takes its value per
    call), so a 16-bit cache with one is refused there as on the host, not planned without it."""
    from cupyflash import _interop, _kvcache

    dtypes = {"q": "bfloat16", "k_cache": "bfloat16", "v_cache": "bfloat16", "k_new": None, "v_new": None}
    with pytest.raises(TypeError, match="k_scale / v_scale dequantise a float8 cache"):
        _kvcache._gpu_fp8(_interop.CUPY_LIB, dtypes, 2, None, 2.0, None)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("per", ["head", "tensor"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_quantize_fp8_makes_the_cache_and_scale_a_decode_step_reads(rng, fmt, per, layout):
    """quantize_fp8's values and scale: the rule above with scale = amax / the format's largest
    value (per head or for the tensor), and attention_with_kvcache over them equals the float64
    attention over their dequantised values."""
    b, length, hq, hkv, d = 2, 24, 4, 2, 16
    raw = [rng.standard_normal((b, length, hkv, d)) * np.array([0.01, 30.0])[:, None] for _ in "kv"]
    shaped = [x.transpose(0, 2, 1, 3).copy() if layout == "bhsd" else x for x in raw]
    results = [cupyflash.quantize_fp8(x.astype(np.float32), fmt=fmt, per=per, layout=layout) for x in shaped]
    largest = float(ml_dtypes.finfo(FP8[fmt]).max)
    for x, (values, scale) in zip(raw, results):
        assert values.dtype == FP8[fmt] and scale.dtype == np.float32
        assert scale.shape == ((hkv,) if per == "head" else ())
        amax = np.abs(x).max(axis=(0, 1, 3)) if per == "head" else np.abs(x).max()
        np.testing.assert_allclose(scale, amax / largest, rtol=1e-6)
        head_major = values.transpose(0, 2, 1, 3) if layout == "bhsd" else values
        np.testing.assert_array_equal(
            head_major.view(np.uint8), _quantise(x, fmt, _column(scale, hkv).astype(np.float32)).view(np.uint8)
        )
    (k8, k_scale), (v8, v_scale) = results
    if layout == "bhsd":
        k8, v8 = (c.transpose(0, 2, 1, 3).copy() for c in (k8, v8))
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    seqlens = np.array([5, length], dtype=np.int32)
    out = cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_scale=k_scale, v_scale=v_scale)
    ref_k, ref_v = (c.astype(np.float64) * _column(s, hkv) for c, s in zip((k8, v8), (k_scale, v_scale)))
    ref, _ = kv_reference(q.astype(np.float64), ref_k, ref_v, seqlens, False)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-6 * max(1.0, np.abs(ref).max()))


def test_quantize_fp8_edge_values_and_torch():
    x = np.zeros((1, 2, 2, 4), dtype=np.float32)
    x[0, 0, 0] = [1.0, -2.0, np.nan, np.inf]  # head 0: NaN stays, inf saturates, amax over finite values
    values, scale = cupyflash.quantize_fp8(x)
    assert scale.tolist() == [np.float32(2.0 / 448), 1.0]  # head 1 is all zeros: scale 1
    got = values.astype(np.float32)[0, 0, 0]
    assert got[0] == 224.0 and got[1] == -448.0 and np.isnan(got[2]) and got[3] == 448.0
    assert (values.astype(np.float32)[:, :, 1] == 0).all()
    torch = pytest.importorskip("torch")
    t_values, t_scale = cupyflash.quantize_fp8(torch.from_numpy(x).to(torch.bfloat16), fmt="e5m2", per="tensor")
    assert t_values.dtype == torch.float8_e5m2 and t_scale.dtype == torch.float32 and t_scale.shape == ()
    n_values, n_scale = cupyflash.quantize_fp8(x, fmt="e5m2", per="tensor")
    assert float(t_scale) == float(n_scale)
    # the same values (NaN's bytes may differ: torch writes 0xFF, ml_dtypes 0x7E)
    np.testing.assert_array_equal(t_values.to(torch.float32).numpy(), n_values.astype(np.float32))


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"fmt": "e3m4"}, ValueError, "fmt must be"),
        ({"per": "row"}, ValueError, "per must be"),
        ({"layout": "sbhd"}, ValueError, "layout must be"),
    ],
)
def test_quantize_fp8_refuses_bad_options(kw, error, message):
    with pytest.raises(error, match=message):
        cupyflash.quantize_fp8(np.ones((1, 2, 2, 4), np.float32), **kw)


def test_quantize_fp8_refuses_bad_inputs():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        cupyflash.quantize_fp8(np.ones((1, 2, 2, 4), np.int32))
    with pytest.raises(ValueError, match="4-d"):
        cupyflash.quantize_fp8(np.ones((2, 2, 4), np.float32))
    with pytest.raises(TypeError, match="PyTorch tensor or a NumPy array"):
        cupyflash.quantize_fp8([[[[1.0]]]])
