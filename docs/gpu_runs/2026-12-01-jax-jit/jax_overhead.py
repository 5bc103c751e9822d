"""Where the jitted call's time goes: a jitted buffer_callback that does nothing, the jitted
cupyflash forward, the eager cupyflash call on CuPy arrays of the same data, and a cProfile of
the callback's Python (per call), B=4 N=1024 H=16 d=64 bf16."""
import cProfile, io, pstats, time, os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp, cupy
from jax.experimental.buffer_callback import buffer_callback
import cupyflash
from cupyflash import _jax

q = jax.random.normal(jax.random.key(0), (4, 1024, 16, 64), jnp.bfloat16)
def noop(ctx, out, x):
    pass
f0 = jax.jit(lambda x: buffer_callback(noop, jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
f1 = jax.jit(lambda x: cupyflash.attention(x, x, x))
def per_call(f, n=300):
    for _ in range(20): f(q).block_until_ready()
    t = time.perf_counter()
    for _ in range(n): y = f(q)
    y.block_until_ready()
    stream = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n): f(q).block_until_ready()
    return stream, (time.perf_counter() - t) / n * 1e6
print("noop callback: us/call streamed %.1f, each synced %.1f" % per_call(f0))
print("cupyflash jit: us/call streamed %.1f, each synced %.1f" % per_call(f1))
qc = cupy.from_dlpack(q)
for _ in range(20): cupyflash.attention(qc, qc, qc)
cupy.cuda.Device().synchronize()
t = time.perf_counter()
for _ in range(300): cupyflash.attention(qc, qc, qc)
cupy.cuda.Device().synchronize()
print("cupyflash eager (CuPy): us/call streamed %.1f" % ((time.perf_counter() - t) / 300 * 1e6))
pr = cProfile.Profile(); pr.enable()
for _ in range(200): f1(q)
f1(q).block_until_ready(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25); print(s.getvalue()[:6000])
