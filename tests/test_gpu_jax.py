"""``cupyflash.attention`` under ``jax.jit`` on a GPU: the kernels inside the XLA program
(``cupyflash._jax``, one buffer_callback custom call per direction) against float64 (the
reference forward; PyTorch autograd of the naive attention for gradients) with flash-attn's
rule (within the dtype's bound and 2x the naive low-precision error plus a floor). Proof that
the kernels ran, not a traced reference: the compiled program holds the GPU callback and no
dot or GEMM, and the callback's run counter moves. Run with XLA_PYTHON_CLIENT_PREALLOCATE=false
(set here too, before JAX starts) so CuPy's pool and JAX's share the GPU.
"""

from __future__ import annotations

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
