"""``python -m cupyflash demo``: what cupyflash gives on this machine, in a few seconds.

On any machine: causal attention on a small random problem on the host path (the array-API
FA2 in NumPy), and its relative error ``||out - ref|| / ||ref||`` against the float64 reference
(:mod:`cupyflash.reference`). Where CuPy sees a GPU, also the GPU kernel: its error on the same
kind of problem in float16, its time on a larger one beside PyTorch SDPA (where torch with CUDA is
installed), and the memory that naive attention would take for its N x N score matrix, which the
kernel never writes. Then the next command to try.

A tool above the library (as bench.py): the library never imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

# (batch, query length, query heads, KV heads, head dim): GQA, 4 query heads per KV head.
HOST_SHAPE = (1, 512, 8, 2, 64)  # the host path: well under a second
GPU_CHECK_SHAPE = (2, 1024, 16, 4, 128)  # the float64 reference's scores: 256 MiB on the host
GPU_SPEED_SHAPE = (4, 4096, 16, 16, 128)  # prefill-sized (16k tokens, width 2048), as bench.py; MHA for SDPA
# The documented error bounds of the tests (tests/helpers.py: float16 2e-3; the host in float32).
BOUND = {"float32": 1e-5, "float16": 2e-3}

NEXT_GPU = (
    "next: python -m cupyflash bench --quick   (TFLOP/s against PyTorch SDPA's flash and cuDNN backends; "
    "the API: docs/api.md)"
)
NEXT_CPU = (
    "next: python -m cupyflash info   (what this machine has); the API: docs/api.md; "
    "on a machine with an NVIDIA GPU: python -m cupyflash bench --quick"
)


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # no CuPy, or no driver
        return False


def _inputs(shape: tuple[int, int, int, int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random float32 q, k, v in ``bshd`` (never zeros)."""
    b, n, hq, hkv, d = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, hq, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, n, hkv, d), dtype=np.float32) for _ in range(2))
    return q, k, v


def relative_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    from .reference import to_numpy64

    return float(np.linalg.norm(to_numpy64(out) - ref) / np.linalg.norm(ref))


def _describe(shape: tuple[int, int, int, int, int]) -> str:
    b, n, hq, hkv, d = shape
    return f"B={b}, N={n}, {hq} query heads over {hkv} KV heads, d={d}, causal"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _host(echo: Callable[[str], None]) -> float:
    import cupyflash
    from cupyflash import reference

    q, k, v = _inputs(HOST_SHAPE)
    start = time.perf_counter()
    out = cupyflash.attention(q, k, v, causal=True)
    seconds = time.perf_counter() - start
    error = relative_error(out, reference.attention(q, k, v, causal=True))
    echo(f"host (NumPy, float32; array-API FA2): {_describe(HOST_SHAPE)}")
    echo(f"  relative error vs the float64 reference: {error:.2e}  (bound {BOUND['float32']:.0e})")
    echo(f"  time: {seconds * 1e3:.1f} ms (the host path is for checking and small problems; the GPU is for speed)")
    return error


def _cuda_ms(fn: Callable[[], Any], repeat: int = 20) -> float:
    """Median milliseconds of ``fn`` between CuPy events, after a few warm-up calls."""
    import cupy

    for _ in range(3):
        fn()
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(repeat):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(begin, end))
    return float(np.median(samples))


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _gpu(echo: Callable[[str], None], seqlen: int) -> float:
    import cupy

    import cupyflash
    from cupyflash import reference

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    q, k, v = (cupy.asarray(x).astype(cupy.float16) for x in _inputs(GPU_CHECK_SHAPE))
    out = cupyflash.attention(q, k, v, causal=True)  # the first call compiles (or loads from the cache)
    error = relative_error(out, reference.attention(q, k, v, causal=True))  # same rounded inputs
    echo(f"GPU ({name}, float16): {_describe(GPU_CHECK_SHAPE)}")
    echo(f"  relative error vs the float64 reference: {error:.2e}  (bound {BOUND['float16']:.0e})")

    b, _, hq, hkv, d = GPU_SPEED_SHAPE
    shape = (b, seqlen, hq, hkv, d)
    flops = 4.0 * b * hq * seqlen * seqlen * d / 2  # causal: half the square
    torch = _torch_cuda()
    if torch is not None:  # both on torch tensors, on torch's stream, timed with the same events
        gen = torch.Generator(device="cuda").manual_seed(0)
        qt = torch.randn((b, seqlen, hq, d), generator=gen, device="cuda", dtype=torch.float16)
        kt, vt = (torch.randn((b, seqlen, hkv, d), generator=gen, device="cuda", dtype=torch.float16) for _ in "kv")
        from .bench import cuda_times_ms

        sdpa = torch.nn.functional.scaled_dot_product_attention
        q_, k_, v_ = (x.transpose(1, 2) for x in (qt, kt, vt))
        times = cuda_times_ms(
            {
                "cupyflash": lambda: cupyflash.attention(qt, kt, vt, causal=True),
                "sdpa": lambda: sdpa(q_, k_, v_, is_causal=True),
            },
            warmup_ms=200,
            repeat=10,
        )
        ours, theirs = times["cupyflash"], times["sdpa"]
        echo(f"  speed on {_describe(shape)}:")
        echo(f"    cupyflash   {ours:8.3f} ms  {flops / ours / 1e9:6.1f} TFLOP/s")
        echo(f"    torch SDPA  {theirs:8.3f} ms  {flops / theirs / 1e9:6.1f} TFLOP/s  ({theirs / ours:.2f}x ours)")
    else:
        qs = cupy.random.standard_normal((b, seqlen, hq, d), dtype=cupy.float32).astype(cupy.float16)
        ks, vs = (
            cupy.random.standard_normal((b, seqlen, hkv, d), dtype=cupy.float32).astype(cupy.float16) for _ in "kv"
        )
        ours = _cuda_ms(lambda: cupyflash.attention(qs, ks, vs, causal=True))
        echo(
            f"  speed on {_describe(shape)}: {ours:.3f} ms, {flops / ours / 1e9:.1f} TFLOP/s (no SDPA: torch is absent)"
        )
    scores = b * hq * seqlen * seqlen * 2  # float16
    io = (2 * b * seqlen * hq * d + 2 * b * seqlen * hkv * d) * 2  # q, out, k, v
    echo(
        f"  memory: naive attention writes the (B, H, N, N) score matrix, {_bytes(scores)} in float16 "
        f"(and as much again for the probabilities); cupyflash never writes it: its inputs and output are "
        f"{_bytes(io)}, plus {_bytes(b * hq * seqlen * 4)} of float32 log-sum-exp when asked for"
    )
    return error


def run(
    *, gpu: bool | None = None, seqlen: int = GPU_SPEED_SHAPE[1], echo: Callable[[str], None] = print
) -> dict[str, float]:
    """The demo: prints as it goes through ``echo`` and returns the relative errors measured
    (``host``, and ``gpu`` where the GPU ran). ``gpu=None``: the GPU where CuPy sees one."""
    import cupyflash

    echo(f"cupyflash {cupyflash.__version__}: exact attention, out = softmax(q k^T / sqrt(d)) v")
    errors = {"host": _host(echo)}
    if gpu is None:
        gpu = _gpu_available()
    if gpu:
        errors["gpu"] = _gpu(echo, seqlen)
    else:
        echo("GPU: none visible to CuPy (on a machine with an NVIDIA GPU, the cuda13 extra installs CuPy and NVRTC)")
    echo(NEXT_GPU if gpu else NEXT_CPU)
    return errors
