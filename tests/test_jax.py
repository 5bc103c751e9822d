"""JAX inputs. Concrete arrays run as any array (the host path here; the kernels through DLPack
on a GPU). Traced ones (jax.jit, grad, vmap) run ``cupyflash.attention`` as an XLA custom call
(``cupyflash._jax``): on this CPU backend its callback runs the host path, so the custom_vjp
wiring, the abstract shapes, dropout's seed operand and the refusals are all checked here, and
``attention_with_kvcache``'s custom call (the returned caches, donation, vmap, the refused
derivative); the GPU twin is test_gpu_jax.py. The oracle is float64 (the reference forward, PyTorch autograd of
the naive attention for gradients)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import naive_low_precision, need_torch

import cupyflash
from cupyflash import reference

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _inputs(shape_q=(1, 9, 2, 16), shape_kv=(1, 11, 1, 16), seed=0):
    """float32 arrays on JAX's CPU device (the host path; on a GPU machine the default device
    would take them to the GPU kernels, which run float16 and bfloat16)."""
    rng = np.random.default_rng(seed)
    cpu = jax.devices("cpu")[0]
    return [jax.device_put(rng.standard_normal(s).astype(np.float32), cpu) for s in (shape_q, shape_kv, shape_kv)]


def _runs():
    from cupyflash import _jax

    return dict(_jax.runs)


def test_concrete_jax_arrays_run():
    q, k, v = _inputs()
    out = cupyflash.attention(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.shape == q.shape
    ref = reference.attention(*(np.asarray(x) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)


CASES = {
    "causal-gqa-odd": ((2, 9, 4, 16), (2, 11, 2, 16), {"causal": True}),
    "plain": ((1, 7, 2, 8), (1, 7, 2, 8), {}),
    "bhsd-window-softcap": ((1, 2, 13, 16), (1, 1, 6, 16), {"layout": "bhsd", "window": (3, 1), "softcap": 2.0}),
    "scale-nq>nk-causal": ((1, 8, 2, 8), (1, 5, 2, 8), {"causal": True, "scale": 0.7}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_jit_forward_matches_float64_and_runs_the_custom_call(case):
    shape_q, shape_kv, options = CASES[case]
    q, k, v = _inputs(shape_q, shape_kv)
    f = jax.jit(lambda q, k, v: cupyflash.attention(q, k, v, return_lse=True, **options))
    hlo = f.lower(q, k, v).as_text()
    assert "xla_buffer_python_cpu_callback" in hlo and "dot_general" not in hlo
    before = _runs().get(("cpu", "forward"), 0)
    out, lse = f(q, k, v)
    assert _runs()[("cpu", "forward")] == before + 1
    ref, ref_lse = reference.attention(*(np.asarray(x) for x in (q, k, v)), return_lse=True, **options)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)
    finite = np.isfinite(ref_lse)
    assert (np.isneginf(np.asarray(lse)) == ~finite).all()
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=2e-5, atol=2e-5)


def _torch_grads(q, k, v, dout, dlse=None, **options):
    """(dq, dk, dv) of the float64 naive attention by PyTorch autograd."""
    torch = need_torch()
    leaves = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v)]
    defaults = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, "layout": "bshd"}
    out, lse = naive_low_precision(*leaves, return_lse=True, **(defaults | options))
    loss = (out * torch.tensor(np.asarray(dout, np.float64))).sum()
    if dlse is not None:
        loss = loss + (lse * torch.tensor(np.asarray(dlse, np.float64))).sum()
    loss.backward()
    return [x.grad.numpy() for x in leaves]


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("case", list(CASES))
def test_jit_grad_matches_float64_autograd(case, with_lse):
    shape_q, shape_kv, options = CASES[case]
    q, k, v = _inputs(shape_q, shape_kv)
    rng = np.random.default_rng(1)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = None
    if with_lse:
        p = cupyflash.attention(q, k, v, return_lse=True, **options)[1]
        dlse = jnp.asarray(rng.standard_normal(p.shape), jnp.float32)

    def loss(q, k, v):
        if with_lse:
            out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
            return (out * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return (cupyflash.attention(q, k, v, **options) * dout).sum()

    before = _runs().get(("cpu", "backward"), 0)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert _runs()[("cpu", "backward")] == before + 1
    want = _torch_grads(q, k, v, dout, dlse, **options)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.shape == ref.shape and got.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_eval_shape_states_out_and_lse_without_running():
    structs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 4, 9, 64), (2, 2, 11, 64), (2, 2, 11, 64))]
    before = _runs()
    out, lse = jax.eval_shape(lambda q, k, v: cupyflash.attention(q, k, v, layout="bhsd", return_lse=True), *structs)
    assert (out.shape, out.dtype) == ((2, 4, 9, 64), jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((2, 4, 9), jnp.float32)
    grads = jax.eval_shape(jax.grad(lambda q, k, v: cupyflash.attention(q, k, v).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2)), *[jax.ShapeDtypeStruct(s.shape[:1] + s.shape[2:3] + s.shape[1:2]
                                    + s.shape[3:], s.dtype) for s in structs])  # fmt: skip
    assert [g.shape for g in grads] == [(2, 9, 4, 64), (2, 11, 2, 64), (2, 11, 2, 64)]
    assert all(g.dtype == jnp.bfloat16 for g in grads)
    assert _runs() == before


def test_validation_happens_at_trace_time():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="head_dim"):
        jax.jit(lambda q: cupyflash.attention(q, k[..., :8], v[..., :8]))(q)
    with pytest.raises(TypeError, match="one floating dtype"):
        jax.jit(lambda q: cupyflash.attention(q.astype(jnp.float16), k, v))(q)
    with pytest.raises(TypeError, match="must be a JAX array"):
        jax.jit(lambda q: cupyflash.attention(q, np.asarray(k), v))(q)


def test_vmap_and_grad_without_jit():
    q, k, v = _inputs()
    out = jax.vmap(lambda q: cupyflash.attention(q, k, v, causal=True))(jnp.stack([q, 2 * q]))
    for i, x in enumerate((q, 2 * q)):
        ref = reference.attention(*(np.asarray(y) for y in (x, k, v)), causal=True)
        np.testing.assert_allclose(np.asarray(out[i]), ref, rtol=2e-5, atol=2e-5)
    dq = jax.grad(lambda q: cupyflash.attention(q, k, v).sum())(q)
    want = _torch_grads(q, k, v, np.ones(q.shape))[0]
    np.testing.assert_allclose(np.asarray(dq), want, rtol=1e-4, atol=1e-4)


def test_dropout_seed_is_an_operand_shared_by_forward_and_backward():
    q, k, v = _inputs((1, 9, 2, 16), (1, 11, 2, 16))
    f = jax.jit(lambda q, k, v, seed: cupyflash.attention(q, k, v, dropout_p=0.25, seed=seed))
    host = [np.asarray(x) for x in (q, k, v)]
    for seed in (5, 2**40 + 3):
        words = jnp.asarray([seed % 2**32, seed // 2**32], jnp.uint32)
        np.testing.assert_array_equal(np.asarray(f(q, k, v, words)),
                                      cupyflash.attention(*host, dropout_p=0.25, seed=seed))  # fmt: skip
    a, b = f(q, k, v, jnp.uint32(5)), f(q, k, v, jnp.uint32(6))  # one compiled function, two masks
    assert not np.allclose(np.asarray(a), np.asarray(b))
    static = jax.jit(lambda q: cupyflash.attention(q, k, v, dropout_p=0.25, seed=5))(q)
    np.testing.assert_array_equal(np.asarray(static), np.asarray(a))

    dout = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    grads = jax.jit(jax.grad(lambda q, k, v: (cupyflash.attention(q, k, v, dropout_p=0.25, seed=jnp.uint32(7)) * dout)
                             .sum(), argnums=(0, 1, 2)))(q, k, v)  # fmt: skip
    out, lse = cupyflash.attention(*host, dropout_p=0.25, seed=7, return_lse=True)
    want = cupyflash.attention_backward(dout, *host, out, lse, dropout_p=0.25, seed=7)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def test_dropout_without_a_seed_is_refused_by_name():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="needs seed="):
        jax.jit(lambda q: cupyflash.attention(q, k, v, dropout_p=0.1))(q)
    with pytest.raises(ValueError, match="seed must be"):
        jax.jit(lambda q: cupyflash.attention(q, k, v, dropout_p=0.1, seed=jnp.float32(1)))(q)


def test_alibi_slopes_run_and_are_refused_when_differentiated():
    q, k, v = _inputs((1, 9, 2, 16), (1, 11, 1, 16))
    slopes = jnp.asarray([0.5, 0.25], jnp.float32)
    out = jax.jit(lambda q, s: cupyflash.attention(q, k, v, alibi_slopes=s))(q, slopes)
    host = [np.asarray(x) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(out), cupyflash.attention(*host, alibi_slopes=np.asarray(slopes)),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    jax.grad(lambda q: cupyflash.attention(q, k, v, alibi_slopes=slopes).sum())(q)  # constant slopes: fine
    with pytest.raises(RuntimeError, match="slopes get no gradient"):
        jax.grad(lambda s: cupyflash.attention(q, k, v, alibi_slopes=s).sum())(slopes)


def test_jit_grad_with_sinks_matches_the_host_path():
    """Learnable sinks through jax.jit and jax.grad: the forward and every gradient, the sinks'
    included, equal the eager host path's (attention_backward) on the same float32 values."""
    q, k, v = _inputs()
    sinks = jax.device_put(np.array([0.5, -1.0], np.float32), jax.devices("cpu")[0])

    def loss(q, k, v, sinks):
        out, lse = cupyflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
        return jnp.sum(out * out) + jnp.sum(lse)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    host = [np.asarray(x) for x in (q, k, v, sinks)]
    out, lse = cupyflash.attention(*host[:3], causal=True, sinks=host[3], return_lse=True)
    want = cupyflash.attention_backward(2 * out, *host[:3], out, lse, dlse=np.ones_like(lse), causal=True,
                                        sinks=host[3])  # fmt: skip
    np.testing.assert_allclose(float(value), float(np.sum(out * out) + np.sum(lse)), rtol=1e-5)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=2e-5)
    with pytest.raises(TypeError, match="sinks must be float32"):
        jax.jit(lambda q: cupyflash.attention(q, k, v, sinks=sinks.astype(jnp.float16)))(q)


@pytest.mark.parametrize(
    "call",
    [
        lambda x, k, v: cupyflash.attention_backward(x, x, k, v, x, jnp.zeros((1, 2, 9), jnp.float32)),
        lambda x, k, v: cupyflash.merge_states(
            x, jnp.zeros((1, 2, 9), jnp.float32), x, jnp.zeros((1, 2, 9), jnp.float32)
        ),  # fmt: skip
    ],
    ids=["attention_backward", "merge_states"],
)
def test_other_entry_points_refuse_traced_arrays_with_the_way_out(call):
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="only attention\\(\\) and attention_with_kvcache\\(\\) run inside JAX"):
        jax.jit(lambda x: call(x, k, v))(q)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache: one custom call, the appended caches returned (JAX arrays are
# immutable). The oracle is the eager host call on NumPy copies, which appends in place and runs
# the same host path as the callback: the results agree bit for bit.
# ---------------------------------------------------------------------------------------------
# (Nq, Nnew, page_size (0: contiguous), extras, options): extras among "int" (an int
# cache_seqlens), "lse", "rotary", "batch_idx" (with cache_leftpad), "alibi".
KV_CASES = {
    "contiguous-decode": (1, 0, 0, (), {}),
    "contiguous-append-int-lse": (3, 2, 0, ("int", "lse"), {}),
    "paged-append-lse": (2, 3, 4, ("lse",), {}),
    "paged-decode-int": (1, 0, 8, ("int",), {"causal": False}),
    "rotary-append": (2, 2, 0, ("rotary",), {}),
    "batch-idx-leftpad-append": (1, 1, 0, ("batch_idx", "lse"), {}),
    "alibi-window-softcap": (4, 2, 4, ("alibi",), {"window": (5, 0), "softcap": 3.0, "scale": 0.3}),
    "sinks-paged-append-lse": (2, 2, 4, ("sinks", "lse"), {}),
}
_B, _HQ, _HKV, _D, _CAPACITY = 3, 4, 2, 16, 24


def _cache_case(case, seed=0):
    """(arrays, static): the call's arrays as float32 / int32 NumPy, by keyword, and its other
    keywords."""
    nq, new, page_size, extras, options = KV_CASES[case]
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    entries = _B + 2 if "batch_idx" in extras else _B
    arrays = {"q": normal(_B, nq, _HQ, _D)}
    if page_size:
        num_pages = _B * _CAPACITY // page_size + 2
        arrays["k_cache"], arrays["v_cache"] = normal(num_pages, page_size, _HKV, _D), normal(num_pages, page_size,
                                                                                              _HKV, _D)  # fmt: skip
        pages = rng.permutation(num_pages)[: _B * _CAPACITY // page_size]
        arrays["block_table"] = pages.reshape(_B, -1).astype(np.int32)
    else:
        arrays["k_cache"], arrays["v_cache"] = normal(entries, _CAPACITY, _HKV, _D), normal(entries, _CAPACITY, _HKV,
                                                                                            _D)  # fmt: skip
    if new:
        arrays["k_new"], arrays["v_new"] = normal(_B, new, _HKV, _D), normal(_B, new, _HKV, _D)
    static = dict(options)
    lengths = rng.integers(1, _CAPACITY - new + 1, _B).astype(np.int32)
    if "int" in extras:
        static["cache_seqlens"] = _CAPACITY - new - 3
    else:
        arrays["cache_seqlens"] = lengths
    if "lse" in extras:
        static["return_lse"] = True
    if "rotary" in extras:
        theta = rng.uniform(0, 2 * np.pi, (_CAPACITY + nq, _D // 4))
        arrays["rotary_cos"], arrays["rotary_sin"] = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        static["rotary_interleaved"] = False
    if "batch_idx" in extras:
        arrays["cache_batch_idx"] = rng.permutation(entries)[:_B].astype(np.int32)
        arrays["cache_leftpad"] = (lengths // 2).astype(np.int32)
    if "alibi" in extras:
        arrays["alibi_slopes"] = rng.uniform(0.05, 0.5, _HQ).astype(np.float32)
    if "sinks" in extras:
        arrays["sinks"] = rng.standard_normal(_HQ).astype(np.float32)
    return arrays, static


def _on_cpu(arrays, dtype=None):
    cpu = jax.devices("cpu")[0]
    return {n: jax.device_put(x if dtype is None or x.dtype != np.float32 else x.astype(dtype), cpu)
            for n, x in arrays.items()}  # fmt: skip


def _eager_host(arrays, static):
    """The eager host call on copies: (result, k_cache, v_cache) as appended in place."""
    copies = {n: x.copy() for n, x in arrays.items()}
    result = cupyflash.attention_with_kvcache(**copies, **static)
    return result, copies["k_cache"], copies["v_cache"]


def _assert_results_equal(got, want, return_lse, exact=True):
    for g, w in zip(got, want) if return_lse else [(got, want)]:
        assert isinstance(g, jax.Array)
        if exact:
            np.testing.assert_array_equal(np.asarray(g), w)
        else:
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(KV_CASES))
def test_jit_cache_call_matches_the_eager_host_call(case):
    arrays, static = _cache_case(case)
    appends = "k_new" in arrays
    want, k_want, v_want = _eager_host(arrays, static)
    inputs = _on_cpu(arrays)
    f = jax.jit(lambda arrays: cupyflash.attention_with_kvcache(**arrays, **static))
    assert "xla_buffer_python_cpu_callback" in f.lower(inputs).as_text()
    before = _runs().get(("cpu", "kvcache"), 0)
    got = f(inputs)
    assert _runs()[("cpu", "kvcache")] == before + 1
    # Concrete JAX arrays: the same return form; with k_new the same custom call, without it the
    # host path in JAX's namespace (the same algorithm, another rounding).
    eager = cupyflash.attention_with_kvcache(**inputs, **static)
    for returned, exact in ((got, True), (eager, appends)):
        if appends:
            result, k_cache, v_cache = returned
            np.testing.assert_array_equal(np.asarray(k_cache), k_want)
            np.testing.assert_array_equal(np.asarray(v_cache), v_want)
        else:
            result = returned
        _assert_results_equal(result, want, static.get("return_lse", False), exact)
    assert _runs()[("cpu", "kvcache")] == before + 1 + appends  # without k_new eager runs the host path directly
    for name, x in inputs.items():  # JAX arrays are immutable: the caches passed in keep their tokens
        np.testing.assert_array_equal(np.asarray(x), arrays[name], err_msg=name)


def test_jit_cache_call_bfloat16_computes_in_float32():
    arrays, static = _cache_case("paged-append-lse", seed=1)
    rounded = {n: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) if x.dtype == np.float32 else x
               for n, x in arrays.items()}  # fmt: skip
    (out, lse), k_want, _ = _eager_host(rounded, static)
    (got, got_lse), k_cache, v_cache = jax.jit(lambda a: cupyflash.attention_with_kvcache(**a, **static))(
        _on_cpu(arrays, jnp.bfloat16)
    )
    assert got.dtype == k_cache.dtype == v_cache.dtype == jnp.bfloat16 and got_lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(out, jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(got_lse), lse)
    np.testing.assert_array_equal(np.asarray(k_cache.astype(jnp.float32)), k_want)


def test_donated_caches_are_appended_in_place_step_after_step():
    arrays, static = _cache_case("paged-append-lse", seed=2)
    host = {n: x.copy() for n, x in arrays.items()}
    step = jax.jit(
        lambda q, k_cache, v_cache, k_new, v_new, seqlens, table: cupyflash.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new
        ),
        donate_argnums=(1, 2),
    )
    a = _on_cpu(arrays)
    # Buffers XLA owns (device_put may share a NumPy array's memory, which XLA cannot donate).
    k_cache, v_cache = jnp.copy(a["k_cache"]), jnp.copy(a["v_cache"])
    seqlens = arrays["cache_seqlens"] % 8  # room for three steps of three tokens
    for t in range(3):
        pointers = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
        old = k_cache
        lengths = jnp.asarray(seqlens + 3 * t)
        out, k_cache, v_cache = step(a["q"], k_cache, v_cache, a["k_new"] + t, a["v_new"] - t, lengths,
                                     a["block_table"])  # fmt: skip
        assert old.is_deleted(), "the donated cache was consumed"
        assert (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()) == pointers, "a copy, not in place"
        want = cupyflash.attention_with_kvcache(
            host["q"], host["k_cache"], host["v_cache"], cache_seqlens=seqlens + 3 * t,
            block_table=host["block_table"], k_new=host["k_new"] + t, v_new=host["v_new"] - t,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(k_cache), host["k_cache"])
    np.testing.assert_array_equal(np.asarray(v_cache), host["v_cache"])


def test_vmap_runs_the_cache_call_per_element():
    arrays, static = _cache_case("contiguous-append-int-lse", seed=3)
    inputs = _on_cpu(arrays)
    qs = jnp.stack([inputs["q"], -inputs["q"]])
    k_news = jnp.stack([inputs["k_new"], 2 * inputs["k_new"]])

    def call(q, k_new):
        return cupyflash.attention_with_kvcache(q, inputs["k_cache"], inputs["v_cache"], k_new=k_new,
                                               v_new=inputs["v_new"], **static)  # fmt: skip

    before = _runs().get(("cpu", "kvcache"), 0)
    (out, lse), k_cache, v_cache = jax.jit(jax.vmap(call))(qs, k_news)
    assert _runs()[("cpu", "kvcache")] == before + 2
    for i in range(2):  # each element appends to its own copy of the shared caches
        one = dict(arrays, q=np.asarray(qs[i]), k_new=np.asarray(k_news[i]))
        (want, want_lse), k_want, v_want = _eager_host(one, static)
        np.testing.assert_array_equal(np.asarray(out[i]), want)
        np.testing.assert_array_equal(np.asarray(lse[i]), want_lse)
        np.testing.assert_array_equal(np.asarray(k_cache[i]), k_want)
        np.testing.assert_array_equal(np.asarray(v_cache[i]), v_want)


def test_differentiating_the_cache_call_raises_by_name():
    arrays, static = _cache_case("contiguous-append-int-lse", seed=4)
    a = _on_cpu(arrays)
    static = {n: x for n, x in static.items() if n != "return_lse"}

    def loss(q, k_new):
        out, k_cache, _ = cupyflash.attention_with_kvcache(q, a["k_cache"], a["v_cache"], k_new=k_new, v_new=a["v_new"],
                                                           **static)  # fmt: skip
        return out.sum() + k_cache.sum()

    with pytest.raises(TypeError, match="no derivative .*inference only.* q is differentiated"):
        jax.grad(loss)(a["q"], a["k_new"])
    with pytest.raises(TypeError, match="k_new is differentiated"):
        jax.jit(jax.grad(loss, argnums=1))(a["q"], a["k_new"])
    with pytest.raises(TypeError, match="q, k_new are differentiated"):
        jax.jvp(loss, (a["q"], a["k_new"]), (jnp.ones_like(a["q"]), jnp.ones_like(a["k_new"])))
    # not differentiated (stop_gradient): the gradient of the rest of the loss
    grad = jax.grad(lambda q: loss(jax.lax.stop_gradient(q), a["k_new"]) + (q * q).sum())(a["q"])
    np.testing.assert_allclose(np.asarray(grad), 2 * arrays["q"], rtol=1e-6)


def test_cache_call_is_checked_at_trace_time_and_by_value_at_run_time():
    arrays, static = _cache_case("paged-append-lse", seed=5)
    a = _on_cpu(arrays)
    table = a.pop("block_table")

    def call(**changes):
        return jax.jit(lambda table: cupyflash.attention_with_kvcache(**(a | {"block_table": table} | changes)))(table)

    with pytest.raises(TypeError, match="block_table must be a JAX array"):
        jax.jit(lambda q: cupyflash.attention_with_kvcache(**(a | {"q": q, "block_table": arrays["block_table"]})))(
            a["q"]
        )
    with pytest.raises(TypeError, match="block_table must be an integer array"):
        jax.jit(lambda t: cupyflash.attention_with_kvcache(**a, block_table=t.astype(jnp.float32)))(table)
    with pytest.raises(TypeError, match="k_new must have q's real floating dtype"):
        call(k_new=a["k_new"].astype(jnp.float16))
    with pytest.raises(ValueError, match="k_new and v_new go together"):
        call(v_new=None)
    with pytest.raises(ValueError, match="cache_seqlens"):  # an int beyond the capacity, at trace time
        call(cache_seqlens=_CAPACITY)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=-1)
    bad = jnp.asarray(arrays["cache_seqlens"]).at[1].set(_CAPACITY)  # a value: checked by the host path as it runs
    with pytest.raises(Exception, match="cache_seqlens\\[1\\]=24"):
        jax.block_until_ready(call(cache_seqlens=bad))


def test_flash_attn_with_kvcache_returns_the_new_caches_for_jax_arrays():
    from cupyflash.flash_attn import flash_attn_with_kvcache

    arrays, _ = _cache_case("paged-append-lse", seed=6)
    (want, want_lse), k_want, v_want = _eager_host(arrays, {"return_lse": True})
    a = _on_cpu(arrays)
    given = {"k_cache": a["k_cache"], "v_cache": a["v_cache"], "k": a["k_new"], "v": a["v_new"],
             "cache_seqlens": a["cache_seqlens"], "block_table": a["block_table"], "causal": True}  # fmt: skip
    out, k_cache, v_cache = jax.jit(lambda q: flash_attn_with_kvcache(q, **given))(a["q"])
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(k_cache), k_want)
    (out, lse), _, _ = flash_attn_with_kvcache(a["q"], **given, return_softmax_lse=True)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)


def test_importing_cupyflash_does_not_import_jax():
    code = "import sys, cupyflash; cupyflash.attention; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
