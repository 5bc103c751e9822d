"""Float8 KV caches on the GPU: the split-KV kernel over e4m3 / e5m2 caches against the float64
reference of the dequantised caches (no worse than the 16-bit cache's error at the same shape),
the append's bytes against torch's own cast of the documented rule, and CUDA-graph capture.
Outputs are NaN-poisoned before every launch (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, kv_reference, need_torch, rel_error

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
ROWS = {"nq1-gqa4": (1, 8, 2, True), "nq3-gqa4-causal": (3, 8, 2, True), "nq16-mqa8-causal": (16, 8, 1, True)}


def _dtype(torch, fmt):
    return torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2


def _quantise(torch, x, scale, fmt):
    """The documented rule through torch's own cast: float32 quotient, clamped, rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(_dtype(torch, fmt))


def _paginate_bytes(torch, caches, page_size, gen):
    """float8 caches [B, L, H, d] as shuffled pages, paged as their uint8 bytes (torch indexes
    float8 tensors in few ops) by test_gpu_decode's helper."""
    from test_gpu_decode import _paginate

    pages, table = _paginate(torch, [c.view(torch.uint8) for c in caches], page_size, gen)
    return [p.view(c.dtype) for p, c in zip(pages, caches)], table


@pytest.mark.parametrize("page_size", [0, 1, 16, 256], ids=["contiguous", "paged1", "paged16", "paged256"])
@pytest.mark.parametrize("rows", list(ROWS), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_matches_reference_of_dequantised_cache(rng, fmt, dtype, head_dim, rows, page_size):
    torch = need_torch()
    nq, hq, hkv, causal = ROWS[rows]
    b, length, nnew = 4, 1031, nq
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", tdtype)
    k_scale = (torch.rand(hkv, generator=gen) * 0.05 + 0.01).cuda()  # per KV head
    v_scale = torch.tensor(0.02, device="cuda")  # one per tensor
    raw = [torch.randn(b, length, hkv, head_dim, generator=gen).cuda() for _ in "kv"]
    k8, v8 = _quantise(torch, raw[0], k_scale[:, None], fmt), _quantise(torch, raw[1], v_scale, fmt)
    k_new, v_new = (torch.randn(b, nnew, hkv, head_dim, generator=gen).to("cuda", tdtype) for _ in range(2))
    cached = [0, 1, 500, length - nnew]  # ragged, with an empty and a one-token cache
    seqlens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    want_k, want_v = k8.view(torch.uint8).clone(), v8.view(torch.uint8).clone()
    for i, n in enumerate(cached):
        want_k[i, n : n + nnew] = _quantise(torch, k_new[i], k_scale[:, None], fmt).view(torch.uint8)
        want_v[i, n : n + nnew] = _quantise(torch, v_new[i], v_scale, fmt).view(torch.uint8)
    k_cache, v_cache, table = k8, v8, None
    if page_size:
        (k_cache, v_cache), table = _paginate_bytes(torch, (k8, v8), page_size, gen)
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new, causal=causal,
        k_scale=k_scale, v_scale=v_scale, return_lse=True,
    )  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape
    if not page_size:  # the append wrote exactly the rule's bytes, nothing else
        assert torch.equal(k_cache.view(torch.uint8), want_k) and torch.equal(v_cache.view(torch.uint8), want_v)
    deq_k = want_k.view(_dtype(torch, fmt)).double() * k_scale.double()[:, None]
    deq_v = want_v.view(_dtype(torch, fmt)).double() * v_scale.double()
    lengths = [n + nnew for n in cached]
    ref, ref_lse = kv_reference(q.double().cpu().numpy(), deq_k.cpu().numpy(), deq_v.cpu().numpy(), lengths, causal)
    out64 = reference.to_numpy64(out)
    assert not np.isnan(out64).any(), "unwritten (NaN-poisoned) output"
    error = rel_error(out64, ref)
    # the 16-bit path at the same shape, over the dequantised values rounded to q's dtype
    k16, v16 = deq_k.to(tdtype), deq_v.to(tdtype)
    out16 = cupyflash.attention_with_kvcache(q, k16, v16, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                             device="cuda"), causal=causal)  # fmt: skip
    ref16 = kv_reference(q.double().cpu().numpy(), k16.double().cpu().numpy(), v16.double().cpu().numpy(), lengths,
                         causal)[0]  # fmt: skip
    error16 = rel_error(reference.to_numpy64(out16), ref16)
    # The floor of q's dtype: the exact answer over the dequantised cache rounded to it. The 16-bit
    # path's reference holds values already in q's dtype, so its one-key sequence (output = v) is
    # exact and its error can sit below that floor, which no kernel of the fp8 cache can reach.
    floor = rel_error(reference.to_numpy64(torch.from_numpy(ref).to(tdtype)), ref)
    assert error < BOUND[dtype] and error <= 1.25 * max(error16, floor) + 1e-5, (error, error16, floor)
    lse64, finite = reference.to_numpy64(lse), np.isfinite(ref_lse)
    assert (np.isneginf(lse64) == np.isneginf(ref_lse)).all()
    np.testing.assert_allclose(lse64[finite], ref_lse[finite], atol=2e-2)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_append_bytes_match_torch_cast(rng, fmt, dtype):
    """k_new / v_new through the rule, byte for byte, including values that saturate (x 1e3 / scale)
    and ties; a Python float scale and a (1,) array; CuPy-style uint8 bytes with kv_dtype."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hkv, d = 3, 64, 2, 128
    tdtype = getattr(torch, dtype)
    k8 = torch.zeros(b, length, hkv, d, dtype=torch.uint8, device="cuda")
    v8 = torch.zeros_like(k8)
    k_new = (torch.randn(b, 5, hkv, d, generator=gen) * torch.tensor([1.0, 1e3]).repeat(d // 2)).to("cuda", tdtype)
    v_new = torch.randn(b, 5, hkv, d, generator=gen).to("cuda", tdtype)
    q = torch.randn(b, 1, 4, d, generator=gen).to("cuda", tdtype)
    cached = [0, 17, 59]
    v_scale = torch.tensor([0.03], device="cuda")
    cupyflash.attention_with_kvcache(
        q, k8, v8, cache_seqlens=torch.tensor(cached, dtype=torch.int32, device="cuda"), k_new=k_new, v_new=v_new,
        k_scale=0.125, v_scale=v_scale, kv_dtype=fmt,
    )  # fmt: skip
    for i, n in enumerate(cached):
        assert torch.equal(k8[i, n : n + 5], _quantise(torch, k_new[i], 0.125, fmt).view(torch.uint8))
        assert torch.equal(v8[i, n : n + 5], _quantise(torch, v_new[i], v_scale, fmt).view(torch.uint8))
    untouched = torch.ones(length, dtype=torch.bool)
    untouched[cached[0] : cached[0] + 5] = False
    assert not k8[0, untouched.cuda()].any(), "only the new rows are written"


def test_fp8_cuda_graph_capture_replays(rng):
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 2, 512, 8, 2, 128
    q = torch.randn(b, 1, hq, d, generator=gen).to("cuda", torch.bfloat16)
    k8, v8 = (torch.randn(b, length, hkv, d, generator=gen).cuda().to(torch.float8_e4m3fn) for _ in range(2))
    k_new, v_new = (torch.randn(b, 1, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    k_scale = torch.full((hkv,), 0.5, device="cuda")
    seqlens = torch.tensor([10, 300], dtype=torch.int32, device="cuda")
    step = lambda: cupyflash.attention_with_kvcache(  # noqa: E731
        q, k8, v8, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, k_scale=k_scale, v_scale=0.25
    )
    step()  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    seqlens.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    want = step()  # the same step again, eagerly: the same cache position, the same bytes
    assert torch.equal(out, want)
    k_scale.fill_(1.0)  # a device scale is read at replay time
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, want)


def test_a_host_float_scale_on_a_16_bit_cache_is_refused():
    torch = need_torch()
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 32, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_scale / v_scale dequantise a float8 cache"):
        cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=8, k_scale=2.0)


@pytest.mark.parametrize("q_magnitude", [1e5, 1e-5])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_bf16_queries_beyond_fp16_range(rng, fmt, q_magnitude):
    """The float8 path's MMAs run in fp16: bf16 queries far above fp16's range (1e5 overflows it)
    or far below (1e-5 * N(0, 1) is mostly fp16-subnormal) are scaled by a power of two first, so
    the error stays that of the 16-bit cache at the same shape."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 3, 777, 8, 2, 128
    q = (torch.randn(b, 2, hq, d, generator=gen) * q_magnitude).to("cuda", torch.bfloat16)
    scale = 1.0 / (q_magnitude * d**0.5) if q_magnitude > 1 else None  # keep the softmax non-trivial
    k8, v8 = (torch.randn(b, length, hkv, d, generator=gen).cuda().to(_dtype(torch, fmt)) for _ in "kv")
    lengths = [1, 400, length]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, causal=True, scale=scale)
    k64, v64 = k8.double().cpu().numpy(), v8.double().cpu().numpy()
    ref = kv_reference(q.double().cpu().numpy(), k64, v64, lengths, True, scale)[0]
    error = rel_error(reference.to_numpy64(out), ref)
    out16 = cupyflash.attention_with_kvcache(
        q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), cache_seqlens=seqlens, causal=True, scale=scale
    )
    error16 = rel_error(reference.to_numpy64(out16), ref)
    floor = rel_error(reference.to_numpy64(torch.from_numpy(ref).to(torch.bfloat16)), ref)
    assert error <= 1.25 * max(error16, floor) + 1e-5, (error, error16, floor)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_an_infinite_bf16_query_element_leaves_the_other_rows_finite(rng, fmt):
    """bf16 q at 1e5 with one infinite element: the power of two that brings the CTA's rows into
    fp16 is taken over the finite elements, so the other query heads of that KV head (beyond
    fp16's range unscaled) stay finite and right; NaN exactly where the 16-bit cache gives NaN."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 2, 500, 8, 2, 128
    q = (torch.randn(b, 2, hq, d, generator=gen) * 1e5).to(torch.bfloat16)
    q[1, 0, 0, 5] = float("inf")  # batch 1, token 0, query head 0 (KV head 0's CTA)
    q = q.cuda()
    scale = 1.0 / (1e5 * d**0.5)
    k8, v8 = (torch.randn(b, length, hkv, d, generator=gen).cuda().to(_dtype(torch, fmt)) for _ in "kv")
    out = reference.to_numpy64(cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=length, scale=scale))
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    out16 = reference.to_numpy64(cupyflash.attention_with_kvcache(q, k16, v16, cache_seqlens=length, scale=scale))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out16))
    lengths = [length] * b
    ref = kv_reference(q.double().cpu().numpy(), k8.double().cpu().numpy(), v8.double().cpu().numpy(), lengths,
                       False, scale)[0]  # fmt: skip
    finite = ~np.isnan(out16).any(axis=-1) & ~np.isnan(ref).any(axis=-1)
    assert finite[1, 0, 1:4].all() and finite[1, 1, :4].all()  # the CTA's other rows
    error, error16 = (rel_error(o[finite], ref[finite]) for o in (out, out16))
    floor = rel_error(reference.to_numpy64(torch.from_numpy(ref[finite]).to(torch.bfloat16)), ref[finite])
    assert error <= 1.25 * max(error16, floor) + 1e-5, (error, error16, floor)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_nan_byte_gives_nan_where_the_16_bit_cache_would(rng, fmt, where):
    """A NaN byte in the cache (0x7f in both formats) widens to NaN: in a key, the whole rows of
    the query heads of its KV head in its sequence are NaN (their scores are); in a value, that
    column of those rows. Every other element is what the clean cache gives, bit for bit."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, length, hq, hkv, d = 3, 700, 8, 2, 64
    q = torch.randn(b, 1, hq, d, generator=gen).to("cuda", torch.bfloat16)
    k8, v8 = (torch.randn(b, length, hkv, d, generator=gen).cuda().to(_dtype(torch, fmt)) for _ in "kv")
    want = reference.to_numpy64(cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=length))
    (k8 if where == "k" else v8).view(torch.uint8)[1, 345, 0, 17] = 0x7F
    out = reference.to_numpy64(cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=length))
    hit = np.zeros(out.shape, dtype=bool)
    if where == "k":
        hit[1, :, :4] = True  # batch 1, the 4 query heads of KV head 0: every column
    else:
        hit[1, :, :4, 17] = True
    assert np.isnan(out[hit]).all() and not np.isnan(out[~hit]).any()
    np.testing.assert_array_equal(out[~hit], want[~hit])
