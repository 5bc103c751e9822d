"""JAX inputs. Concrete arrays run as any array (the host path here; the kernels through DLPack
on a GPU). Traced ones (jax.jit, grad, vmap) run ``cupyflash.attention`` as an XLA custom call
(``cupyflash._jax``): on this CPU backend its callback runs the host path, so the custom_vjp
wiring, the abstract shapes, dropout's seed operand and the refusals are all checked here; the
GPU twin is test_gpu_jax.py. The oracle is float64 (the reference forward, PyTorch autograd of
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


@pytest.mark.parametrize(
    "call",
    [
        lambda x, k, v: cupyflash.attention_backward(x, x, k, v, x, jnp.zeros((1, 2, 9), jnp.float32)),
        lambda x, k, v: cupyflash.attention_with_kvcache(x, k, v, cache_seqlens=11),
    ],
    ids=["attention_backward", "attention_with_kvcache"],
)
def test_other_entry_points_refuse_traced_arrays_with_the_way_out(call):
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="only attention\\(\\) runs inside JAX transformations"):
        jax.jit(lambda x: call(x, k, v))(q)


def test_importing_cupyflash_does_not_import_jax():
    code = "import sys, cupyflash; cupyflash.attention; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
