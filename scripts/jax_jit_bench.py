"""Jitted cupyflash.attention (the XLA custom call of cupyflash._jax) against
jax.nn.dot_product_attention (implementation "cudnn" and "xla") on a few shapes, forward and
forward + backward, in one process on the same inputs.

    usage: python scripts/jax_jit_bench.py [--dtype bfloat16] [--iters 20] [--shapes small|all]

Each timing: the median of --iters calls of the jitted function after three warm-up calls
(compiles and the kernels' NVRTC compile excluded), each call ended by block_until_ready, so a
call's host overhead (the callback's Python) is part of its time. TFLOP/s count the forward as
4 B H Nq Nk d (halved for causal) and the backward as 2.5x that (docs: the benchmark rules).
A backend that fails on a shape (cuDNN's limits on head_dim, dtype or GQA) prints its error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy's pool and JAX's share the GPU

# (B, N, Hq, Hkv, d, causal)
SHAPES = {
    "small": [(4, 1024, 16, 16, 64, False), (4, 1024, 16, 4, 128, True), (2, 4096, 16, 16, 128, True)],
    "all": [
        (4, 1024, 16, 16, 64, False),
        (4, 1024, 16, 4, 128, True),
        (2, 4096, 16, 16, 128, True),
        (1, 8192, 32, 8, 128, True),
        (1, 16384, 16, 16, 128, True),
    ],
}


def _time(fn, args, iters):
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _backends(jax, causal):
    import cupyflash

    def ours(q, k, v):
        return cupyflash.attention(q, k, v, causal=causal)

    found = {"cupyflash": ours}
    for implementation in ("cudnn", "xla"):

        def sdpa(q, k, v, implementation=implementation):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

        found[f"jax.nn.dpa[{implementation}]"] = sdpa
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default="small", choices=tuple(SHAPES))
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = getattr(jnp, args.dtype)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.dtype}, median of {args.iters}")
    print(f"{'shape (B, N, Hq, Hkv, d, causal)':36} {'backend':22} {'fwd ms':>8} {'TFLOP/s':>8} "
          f"{'fwd+bwd ms':>11} {'TFLOP/s':>8}")  # fmt: skip
    rng = np.random.default_rng(0)
    for b, n, hq, hkv, d, causal in SHAPES[args.shapes]:
        q = jnp.asarray(rng.standard_normal((b, n, hq, d), np.float32), dtype)
        k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, d), np.float32), dtype) for _ in range(2))
        flops = 4 * b * hq * n * n * d / (2 if causal else 1)
        for name, fn in _backends(jax, causal).items():
            forward = jax.jit(fn)
            train = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            label = str((b, n, hq, hkv, d, causal))
            try:
                t_fwd = _time(forward, (q, k, v), args.iters)
                t_train = _time(train, (q, k, v), args.iters)
            except Exception as error:  # a backend's own limits: reported, the others still run
                print(f"{label:36} {name:22} failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}")
                continue
            print(f"{label:36} {name:22} {t_fwd * 1e3:8.3f} {flops / t_fwd / 1e12:8.1f} "
                  f"{t_train * 1e3:11.3f} {3.5 * flops / t_train / 1e12:8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
