"""JAX inputs: concrete arrays run (the host path here; the kernels through DLPack on a GPU), and
traced ones (jax.jit, grad, vmap) are refused with the way out instead of failing inside the
algorithms or tracing a reference in place of the kernels."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

jax = pytest.importorskip("jax")


def _inputs():
    """float32 arrays on JAX's CPU device (the host path; on a GPU machine the default device
    would take them to the GPU kernels, which run float16 and bfloat16)."""
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]
    shapes = ((1, 9, 2, 16), (1, 11, 1, 16), (1, 11, 1, 16))
    return [jax.device_put(rng.standard_normal(s).astype(np.float32), cpu) for s in shapes]


def test_concrete_jax_arrays_run():
    q, k, v = _inputs()
    out = cupyflash.attention(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.shape == q.shape
    ref = reference.attention(*(np.asarray(x) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: jax.jit(f)(x),
        lambda f, x: jax.grad(lambda y: f(y).sum())(x),
        lambda f, x: jax.vmap(f)(x[None]),
    ],
    ids=["jit", "grad", "vmap"],
)
def test_traced_arrays_are_refused_with_the_way_out(transform):
    q, k, v = _inputs()

    def f(x):
        return cupyflash.attention(x, k, v)

    with pytest.raises(TypeError, match="cannot run inside jax.jit"):
        transform(f, q)
