"""``cupyflash.attention`` under ``jax.jit`` on a GPU: the kernels inside the XLA program
(``cupyflash._jax``, one buffer_callback custom call per direction) against float64 (the
reference forward; PyTorch autograd of the naive attention for gradients) with flash-attn's
rule (within the dtype's bound and 2x the naive low-precision error plus a floor). Proof that
the kernels ran, not a traced reference: the compiled program holds the GPU callback and no
dot or GEMM, and the callback's run counter moves. ``attention_with_kvcache`` under jit against the
eager PyTorch call on the same values (the same plan and kernels), its returned caches, donation
and the device-value errors. Run with XLA_PYTHON_CLIENT_PREALLOCATE=false
(set here too, before JAX starts) so CuPy's pool and JAX's share the GPU.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import BOUND, FLOOR, naive_low_precision, need_torch, rel_error  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import reference  # noqa: E402

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = jax.numpy

DTYPES = ("float16", "bfloat16")
# (B, Nq, Nk, Hq, Hkv, d, causal, layout)
CASES = {
    "square": (2, 128, 128, 4, 4, 64, False, "bshd"),
    "causal-gqa-odd": (1, 97, 200, 6, 2, 64, True, "bshd"),
    "causal-mqa-nq>nk": (2, 200, 97, 4, 1, 128, True, "bshd"),
    "bhsd-odd": (1, 33, 77, 4, 2, 128, False, "bhsd"),
}


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU (install jax with its CUDA plugin)")


def _runs(key):
    from cupyflash import _jax

    return _jax.runs.get(key, 0)


def _inputs(rng, case, dtype):
    b, nq, nk, hq, hkv, d, causal, layout = CASES[case]
    shapes = ((b, nq, hq, d), (b, nk, hkv, d)) if layout == "bshd" else ((b, hq, nq, d), (b, hkv, nk, d))
    host = [rng.standard_normal(s).astype(np.float32) for s in (shapes[0], shapes[1], shapes[1])]
    device = _gpu()
    arrays = [jax.device_put(jnp.asarray(h, dtype), device) for h in host]
    return arrays, {"causal": causal, "layout": layout}


def _f64(x):
    return np.asarray(x.astype(jnp.float32), np.float64)


def _assert_kernels_only(compiled_text):
    assert "xla_buffer_python_gpu_callback" in compiled_text, "the cupyflash custom call is missing"
    for op in (" dot(", "__cublas", "cudnn"):
        assert op not in compiled_text, f"the program computes attention itself ({op.strip()} found)"


def _check(got, ref, low, dtype, name):
    err, naive_err = rel_error(got, ref), rel_error(low, ref)
    assert not np.isnan(got).any(), f"{name}: NaN (an unwritten, poisoned element?)"
    assert err <= 2 * BOUND[dtype], f"{name}: relative error {err:.2e} over {2 * BOUND[dtype]}"
    assert err <= 2 * naive_err + FLOOR[dtype], f"{name}: error {err:.2e} > 2 x naive {naive_err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_jit_forward_runs_the_kernels_and_matches_float64(rng, case, dtype):
    torch = need_torch()
    (q, k, v), options = _inputs(rng, case, dtype)
    f = jax.jit(lambda q, k, v: cupyflash.attention(q, k, v, return_lse=True, **options))
    _assert_kernels_only(f.lower(q, k, v).compile().as_text())
    before = _runs(("gpu", "forward"))
    out, lse = f(q, k, v)
    out.block_until_ready()
    assert _runs(("gpu", "forward")) == before + 1
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == jnp.float32
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref, ref_lse = reference.attention(q64, k64, v64, return_lse=True, **options)
    defaults = {"window": (-1, -1), "softcap": 0.0, "scale": None}
    low = naive_low_precision(*(torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q64, k64, v64)),
                              **defaults, **options)  # fmt: skip
    _check(_f64(out), ref, low.double().numpy(), dtype, "out")
    finite = np.isfinite(ref_lse)
    lse = np.asarray(lse)
    assert (np.isneginf(lse) == ~finite).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)


def _torch_grads(torch, arrays, dout, dtype, options):
    leaves = [torch.from_numpy(_f64(x)).to(dtype).requires_grad_(True) for x in arrays]
    out = naive_low_precision(*leaves, window=(-1, -1), softcap=0.0, scale=None, **options)
    (out.double() * torch.from_numpy(dout)).sum().backward()
    return [x.grad.double().numpy() for x in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_jit_grad_runs_the_backward_kernels_and_matches_float64(rng, case, dtype):
    torch = need_torch()
    (q, k, v), options = _inputs(rng, case, dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)

    def loss(q, k, v):
        return (cupyflash.attention(q, k, v, **options).astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    _assert_kernels_only(g.lower(q, k, v).compile().as_text())
    before = _runs(("gpu", "backward"))
    grads = g(q, k, v)
    jax.block_until_ready(grads)
    assert _runs(("gpu", "backward")) == before + 1
    want = _torch_grads(torch, (q, k, v), _f64(dout), torch.float64, options)
    naive = _torch_grads(torch, (q, k, v), _f64(dout), getattr(torch, dtype), options)
    for name, got, ref, low, x in zip(("dq", "dk", "dv"), grads, want, naive, (q, k, v)):
        assert got.dtype == x.dtype and got.shape == x.shape, name
        _check(_f64(got), ref, low, dtype, name)


def test_jit_equals_the_eager_gpu_call_bit_for_bit(rng):
    """One pipeline: the jitted custom call and the eager DLPack route launch the same kernel."""
    (q, k, v), options = _inputs(rng, "causal-gqa-odd", "bfloat16")
    jitted = jax.jit(lambda q, k, v: cupyflash.attention(q, k, v, **options))(q, k, v)
    eager = cupyflash.attention(q, k, v, **options)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))


def test_jit_dropout_seed_operand_forward_and_backward(rng):
    (q, k, v), options = _inputs(rng, "causal-gqa-odd", "float16")
    f = jax.jit(lambda q, k, v, seed: cupyflash.attention(q, k, v, dropout_p=0.2, seed=seed, **options))
    a = f(q, k, v, jnp.uint32(11))
    eager = cupyflash.attention(q, k, v, dropout_p=0.2, seed=11, **options)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(eager))
    assert not np.array_equal(np.asarray(f(q, k, v, jnp.uint32(12))), np.asarray(a))
    dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)

    def loss(q, k, v):
        out = cupyflash.attention(q, k, v, dropout_p=0.2, seed=jnp.uint32(11), **options)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    out, lse = cupyflash.attention(q, k, v, dropout_p=0.2, seed=11, return_lse=True, **options)
    want = cupyflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.2, seed=11, **options)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(_f64(got), _f64(ref), rtol=2e-2, atol=2e-2)


def test_vmap_under_jit_runs_once_per_element(rng):
    (q, k, v), options = _inputs(rng, "causal-gqa-odd", "bfloat16")
    stacked = jnp.stack([q, q * 0.5])
    out = jax.jit(jax.vmap(lambda q: cupyflash.attention(q, k, v, **options)))(stacked)
    for i in range(2):
        want = cupyflash.attention(stacked[i], k, v, **options)
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want))


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache under jax.jit: the custom call against the eager PyTorch call on the
# same values (the same plan and kernels: equal within one rounding of the dtype), the appended
# caches read back from the returned arrays, the inputs unchanged.
# ---------------------------------------------------------------------------------------------
# (B, Nq, Hq, Hkv, d, capacity, Nnew, page_size (0: contiguous), extras); extras among "int" (an
# int cache_seqlens), "lse", "rotary". Nq > 16 is a chunked prefill (the FA2 kernel over the cache).
KV_CASES = {
    "decode-paged16-gqa4-append": (3, 1, 8, 2, 128, 1024, 1, 16, ("lse",)),
    "decode-contiguous-mqa-int": (2, 1, 8, 1, 64, 777, 0, 0, ("int", "lse")),
    "speculative-contiguous-append": (2, 4, 8, 2, 64, 300, 4, 0, ()),
    "prefill-chunk-paged16-append": (2, 40, 8, 2, 128, 512, 40, 16, ("lse",)),
    "rotary-decode-paged16-append": (2, 1, 4, 2, 64, 256, 1, 16, ("rotary", "lse")),
    "sinks-speculative-paged16-append": (2, 3, 8, 2, 128, 1024, 3, 16, ("sinks", "lse")),
}
_STEP = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one rounding step of the dtype, relative


def _cache_arrays(rng, case, dtype):
    """(JAX arrays on the GPU by keyword, the other keywords): floats in ``dtype``, indices int32."""
    b, nq, hq, hkv, d, capacity, new, page_size, extras = KV_CASES[case]
    host = {"q": rng.standard_normal((b, nq, hq, d))}
    if page_size:
        num_pages = b * capacity // page_size + 3
        host["k_cache"], host["v_cache"] = (rng.standard_normal((num_pages, page_size, hkv, d)) for _ in range(2))
        host["block_table"] = rng.permutation(num_pages)[: b * capacity // page_size].reshape(b, -1).astype(np.int32)
    else:
        host["k_cache"], host["v_cache"] = (rng.standard_normal((b, capacity, hkv, d)) for _ in range(2))
    if new:
        host["k_new"], host["v_new"] = (rng.standard_normal((b, new, hkv, d)) for _ in range(2))
    static = {"causal": True, "return_lse": "lse" in extras}
    if "int" in extras:
        static["cache_seqlens"] = capacity - new - 5
    else:
        host["cache_seqlens"] = rng.integers(0, capacity - new + 1, b).astype(np.int32)
        host["cache_seqlens"][0] = capacity - new  # a full cache: the last key of the last page
    if "rotary" in extras:
        theta = rng.uniform(0, 2 * np.pi, (capacity + nq, d // 4))
        host["rotary_cos"], host["rotary_sin"] = np.cos(theta), np.sin(theta)
        static["rotary_interleaved"] = False
    if "sinks" in extras:  # float32, as the kernels read them
        host["sinks"] = rng.standard_normal(hq).astype(np.float32)
    device = _gpu()
    kept = (np.int32, np.float32)  # indices and sinks keep theirs; the rest is the call's dtype
    arrays = {n: jax.device_put(jnp.asarray(x, x.dtype if x.dtype in kept else dtype), device) for n, x in host.items()}
    return arrays, static


def _torch_copies(torch, arrays, dtype):
    """Fresh CUDA tensors holding the JAX arrays' values (never their memory: the eager call
    appends in place)."""
    copies = {}
    for name, x in arrays.items():
        if x.dtype in (jnp.int32, jnp.float32):
            copies[name] = torch.from_numpy(np.asarray(x)).cuda()
        else:
            copies[name] = torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(getattr(torch, dtype))
    return copies


def _np(x):
    return x.double().cpu().numpy() if hasattr(x, "cpu") else _f64(x)


def _assert_within_rounding(got, want, dtype, name):
    got, want = _np(got), _np(want)
    assert not np.isnan(got).any(), f"{name}: NaN (an unwritten, poisoned element?)"
    np.testing.assert_allclose(got, want, rtol=_STEP[dtype], atol=_STEP[dtype], err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(KV_CASES))
def test_jit_cache_call_matches_the_eager_gpu_call(rng, case, dtype):
    torch = need_torch()
    arrays, static = _cache_arrays(rng, case, dtype)
    before_values = {n: np.asarray(x) for n, x in arrays.items()}
    appends = "k_new" in arrays
    f = jax.jit(lambda arrays: cupyflash.attention_with_kvcache(**arrays, **static))
    _assert_kernels_only(f.lower(arrays).compile().as_text())
    before = _runs(("gpu", "kvcache"))
    got = f(arrays)
    jax.block_until_ready(got)
    assert _runs(("gpu", "kvcache")) == before + 1
    copies = _torch_copies(torch, arrays, dtype)
    want = cupyflash.attention_with_kvcache(**copies, **static)
    result = got[0] if appends else got
    out, lse = result if static["return_lse"] else (result, None)
    want_out, want_lse = want if static["return_lse"] else (want, None)
    assert out.dtype == arrays["q"].dtype and out.shape == arrays["q"].shape
    _assert_within_rounding(out, want_out, dtype, "out")
    if lse is not None:
        assert lse.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(lse), want_lse.cpu().numpy(), rtol=1e-5, atol=1e-4)
    if appends:
        for name, cache in zip(("k_cache", "v_cache"), got[1:]):
            assert cache.dtype == arrays[name].dtype and cache.shape == arrays[name].shape
            if "rotary_cos" in arrays:  # the same rotation kernel on the same values
                _assert_within_rounding(cache, copies[name], dtype, name)
            else:  # an append is a copy
                np.testing.assert_array_equal(_np(cache), _np(copies[name]), err_msg=name)
    for name, x in arrays.items():  # JAX arrays are immutable: the inputs keep their values
        np.testing.assert_array_equal(np.asarray(x), before_values[name], err_msg=name)
    cupyflash.check_device_errors()  # every value in range


def test_concrete_jax_arrays_take_the_custom_call_with_k_new_and_dlpack_without(rng):
    arrays, static = _cache_arrays(rng, "decode-paged16-gqa4-append", "bfloat16")
    jitted = jax.jit(lambda arrays: cupyflash.attention_with_kvcache(**arrays, **static))(arrays)
    k_before = np.asarray(arrays["k_cache"])
    before = _runs(("gpu", "kvcache"))
    eager = cupyflash.attention_with_kvcache(**arrays, **static)  # concrete, with k_new: the compiled call
    assert _runs(("gpu", "kvcache")) == before + 1
    for got, want in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(arrays["k_cache"]), k_before)
    read_only = {n: x for n, x in arrays.items() if n not in ("k_new", "v_new")}
    out, lse = cupyflash.attention_with_kvcache(**read_only, **static)  # no k_new: DLPack, in place
    assert _runs(("gpu", "kvcache")) == before + 1
    assert isinstance(out, jax.Array) and out.dtype == arrays["q"].dtype
    want_out, want_lse = jax.jit(lambda a: cupyflash.attention_with_kvcache(**a, **static))(read_only)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_donated_caches_are_appended_in_place_on_the_gpu(rng):
    torch = need_torch()
    arrays, _ = _cache_arrays(rng, "decode-paged16-gqa4-append", "float16")
    copies = _torch_copies(torch, arrays, "float16")
    step = jax.jit(
        lambda q, k_cache, v_cache, k_new, v_new, seqlens, table: cupyflash.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new
        ),
        donate_argnums=(1, 2),
    )
    k_cache, v_cache = jnp.copy(arrays["k_cache"]), jnp.copy(arrays["v_cache"])  # buffers nothing else holds
    seqlens = np.asarray(arrays["cache_seqlens"]) // 2  # room for the steps
    for t in range(3):
        pointers = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
        k_new, v_new = arrays["k_new"] * (t + 1), arrays["v_new"] - t
        out, k_cache, v_cache = step(arrays["q"], k_cache, v_cache, k_new, v_new, jnp.asarray(seqlens + t),
                                     arrays["block_table"])  # fmt: skip
        assert (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()) == pointers, "a copy, not in place"
        want = cupyflash.attention_with_kvcache(
            copies["q"], copies["k_cache"], copies["v_cache"], cache_seqlens=torch.from_numpy(seqlens + t).cuda(),
            block_table=copies["block_table"], k_new=copies["k_new"] * (t + 1), v_new=copies["v_new"] - t,
        )  # fmt: skip
        _assert_within_rounding(out, want, "float16", f"out, step {t}")
    np.testing.assert_array_equal(_np(k_cache), _np(copies["k_cache"]))
    np.testing.assert_array_equal(_np(v_cache), _np(copies["v_cache"]))


@pytest.mark.parametrize("nq", [1, 20], ids=["decode", "fa2"])
def test_jit_bad_page_id_gives_nan_rows_and_a_device_error(nq):
    """A page id outside the cache in a page a sequence uses, under jit: that sequence's rows are
    NaN (O and LSE), nothing is appended through it, the others are right, and
    check_device_errors raises after the jitted call."""
    with contextlib.suppress(cupyflash.DeviceValueError):  # start clean
        cupyflash.check_device_errors()
    device = _gpu()
    rng = np.random.default_rng(nq)
    put = lambda x, dtype: jax.device_put(jnp.asarray(x, dtype), device)  # noqa: E731
    q = put(rng.standard_normal((3, nq, 4, 64)), jnp.float16)
    k_pages, v_pages = (put(rng.standard_normal((9, 16, 2, 64)), jnp.float16) for _ in range(2))
    k_new, v_new = (put(rng.standard_normal((3, 1, 2, 64)), jnp.float16) for _ in range(2))
    table = put([[0, 1, 99], [2, 3, -7], [4, 5, 0]], jnp.int32)
    seqlens = put([47, 47, 31], jnp.int32)  # with the new token: 48, 48 (pages 0-2) and 32 (pages 4, 5)

    def step(q, k_pages, v_pages, k_new, v_new, table, seqlens):
        return cupyflash.attention_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new, return_lse=True
        )

    f = jax.jit(step)
    (out, lse), k_after, v_after = f(q, k_pages, v_pages, k_new, v_new, table, seqlens)
    out64, lse64 = _f64(out), np.asarray(lse, np.float64)
    assert np.isnan(out64[:2]).all() and np.isnan(lse64[:2]).all()
    assert np.isfinite(out64[2]).all() and np.isfinite(lse64[2]).all()
    with pytest.raises(cupyflash.DeviceValueError, match="block_table entry in use was outside"):
        cupyflash.check_device_errors()
    # Only the good sequence appended (its token 31 is slot 15 of page 5); the bad ones wrote nothing.
    for before, new, after in ((k_pages, k_new, k_after), (v_pages, v_new, v_after)):
        want = np.asarray(before).copy()
        want[5, 15] = np.asarray(new)[2, 0]
        np.testing.assert_array_equal(np.asarray(after), want)
    good = jnp.asarray([[0, 1, 2], [3, 6, 7], [4, 5, 8]], jnp.int32)
    jax.block_until_ready(f(q, k_pages, v_pages, k_new, v_new, good, seqlens))
    cupyflash.check_device_errors()  # a good call sets nothing


def test_jit_grad_with_sinks_runs_the_kernels():
    """Learnable sinks under jax.jit + jax.grad on the GPU: the kernels' forward and gradients
    (dsinks summed on the stream into XLA's result) against the float64 host path."""
    gpu = _gpu()
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 97, 4, 64), (2, 130, 2, 64), (2, 130, 2, 64)))
    sinks = rng.standard_normal(4).astype(np.float32)
    args = [jax.device_put(x, gpu) for x in (q, k, v)]
    args = [x.astype(jnp.bfloat16) for x in args] + [jax.device_put(sinks, gpu)]

    def loss(q, k, v, sinks):
        out = cupyflash.attention(q, k, v, causal=True, sinks=sinks)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    before = _runs(("gpu", "backward"))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    assert _runs(("gpu", "backward")) == before + 1
    host = [np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in args]
    out, lse = cupyflash.attention(*host[:3], causal=True, sinks=host[3], return_lse=True)
    want = cupyflash.attention_backward(2 * out, *host[:3], out, lse, causal=True, sinks=host[3])
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, want, strict=True):
        assert rel_error(np.asarray(got.astype(jnp.float32), dtype=np.float64), ref) < 3e-2, name


def test_jit_grad_with_score_and_mask_functions_runs_the_kernels():
    """A score_mod over a captured bias table and a mask_mod over a captured doc_id under jax.jit +
    jax.grad on the GPU: the kernels with the functions compiled in, forward and backward (the run
    counters move), the captured arrays operands (a new doc_id: the same program, its own answer),
    against the float64 host path on the same values."""
    gpu = _gpu()
    from cupyflash import mods

    rng = np.random.default_rng(8)
    shapes = ((2, 97, 4, 64), (2, 130, 2, 64), (2, 130, 2, 64))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    bias = rng.standard_normal((4, 130)).astype(np.float32)
    args = [jax.device_put(x, gpu).astype(jnp.bfloat16) for x in (q, k, v)]

    def functions(table, doc_id):
        score = lambda s, b, h, i, j: 10.0 * mods.tanh(s / 10.0) + table[h, j]  # noqa: E731
        mask = lambda b, h, i, j: (doc_id[i] == doc_id[j]) & (j <= i + 33)  # noqa: E731
        return score, mask

    def loss(q, k, v, table, doc_id):
        score_mod, mask_mod = functions(table, doc_id)
        out = cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    host = [np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in args]
    for groups in (2, 5):
        doc_id = np.sort(rng.integers(0, groups, 130)).astype(np.int32)
        before = (_runs(("gpu", "forward")), _runs(("gpu", "backward")))
        grads = f(*args, jax.device_put(bias, gpu), jax.device_put(doc_id, gpu))
        assert (_runs(("gpu", "forward")), _runs(("gpu", "backward"))) == (before[0] + 1, before[1] + 1)
        score_mod, mask_mod = functions(bias.astype(np.float64), doc_id)
        out, lse = cupyflash.attention(*host, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
        want = cupyflash.attention_backward(2 * out, *host, out, lse, score_mod=score_mod, mask_mod=mask_mod)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
            assert rel_error(np.asarray(got.astype(jnp.float32), dtype=np.float64), ref) < 3e-2, (groups, name)
    assert f._cache_size() == 1


def test_jit_grad_of_a_learned_bias_table_on_the_gpu():
    """jax.jit(jax.grad) with respect to score_mod's captured table as well as q, k, v on the GPU
    (the backward custom call runs the array-API algorithm on CuPy views of XLA's buffers: the
    kernels have no scatter for the table's gradient), bf16, against the same jitted gradient on
    the CPU backend's host path in float32 (which tests/test_mods_traced.py checks against float64
    torch autograd)."""
    gpu = _gpu()
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(12)
    shapes = ((2, 61, 4, 64), (2, 90, 2, 64), (2, 90, 2, 64))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    table = (0.5 * rng.standard_normal((4, 61 + 90))).astype(np.float32)

    def loss(q, k, v, table):
        out = cupyflash.attention(q, k, v, causal=True, score_mod=lambda s, b, h, i, j: s + table[h, j - i + 61])
        return jnp.sum(out.astype(jnp.float32) ** 2)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    before = _runs(("gpu", "backward"))
    got = f(*(jax.device_put(x, gpu).astype(jnp.bfloat16) for x in (q, k, v)), jax.device_put(table, gpu))
    assert _runs(("gpu", "backward")) == before + 1
    rounded = [np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v)]
    want = f(*(jax.device_put(x, cpu) for x in rounded), jax.device_put(table, cpu))
    for name, g, w in zip(("dq", "dk", "dv", "dtable"), got, want, strict=True):
        assert rel_error(np.asarray(g.astype(jnp.float32), dtype=np.float64), np.asarray(w, np.float64)) < 3e-2, name
