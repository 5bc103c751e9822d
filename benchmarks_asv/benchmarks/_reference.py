"""The fixed references the GPU families are read against, measured in the family's own
setup_cache -- the process that times its kernels -- once before them and once after (the mean
of the two medians, so a drift of the clocks over the family's minute falls on both alike).

* ``gemm_tflops``: a bf16 GEMM of fixed size through cuBLAS (CuPy's binding, float32
  accumulation), the compute-bound reference of the prefill, training and baseline families.
* ``copy_gbps``: a device-to-device copy of fixed size (bytes read + written per second), the
  reference of decode. Decode reads the KV cache once and does Hq / Hkv = 4 FLOP per byte read
  (32 query heads over 8 KV heads), where the H200 balances at ~200 (990 TFLOP/s over 4.8 TB/s):
  its speed follows HBM bandwidth, not the tensor-core clock a GEMM tracks. Two hosts whose SM
  and memory clocks differ unequally move a GEMM and decode apart, a copy and decode together.

Why a fixed reference: every asv session may get another H200 host, and between two of them the
same code moved 10-25% (cuDNN at d = 128, N = 1024, asv runs of 261e2f6 and 1661eae). cuBLAS
and the copy engine run the same code for every commit measured (scripts/asv_gpu.sh measures
every commit with one suite, this file included), so a move of a ratio to them is a move of
cupyflash's code. Peers (cuDNN, PyTorch flash) change with the installed PyTorch and stay context.

The mixins at the end give a family's classes their reference entries; a family's module
defines the setup_cache they share (asv runs one per function, keyed by its module and line).

A change of what is measured here changes every ratio series. asv versions a benchmark by the
source of its own code and its setup_cache, not of this module: the sizes are therefore passed
from each family's setup_cache, where changing one starts new series.

Timed as the families time their kernels (cupyflash.bench.cuda_times_ms): CUDA-event medians
after at least 300 ms of warm-up. This module imports no CUDA library at import time: asv's
forkserver imports every benchmark module in the process it forks each benchmark from.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
#: A family's setup_cache result: its values by parameter combination, and its reference's.
_FamilyRun = tuple[dict[tuple[object, ...], float | None], float | None]

WARMUP_MS = 300.0
REPEAT = 50

# cuBLAS enums (library_types.h, cublas_api.h).
_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0


def median_ms(fn: Callable[[], None], *, warmup_ms: float = WARMUP_MS, repeat: int = REPEAT) -> float:
    """Median milliseconds of one call between CUDA events on CuPy's current stream, after at
    least ``warmup_ms`` of calls."""
    import cupy

    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warmup_ms:
        fn()
        cupy.cuda.get_current_stream().synchronize()
    samples = []
    for _ in range(repeat):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(begin, end))
    return float(statistics.median(samples))


def gemm_tflops(*, size: int) -> float:
    """TFLOP/s of C = A B, all ``size`` x ``size`` bf16 (operands of normal values, never zeros),
    float32 accumulation, one cublasGemmEx per call."""
    import cupy
    import numpy as np
    from cupy.cuda import device as cuda_device
    from cupy_backends.cuda.libs import cublas

    rng = cupy.random.default_rng(0)
    # bf16 bit patterns: the upper half of float32 normals.
    a, b = ((rng.standard_normal((size, size), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
            for _ in range(2))  # fmt: skip
    c = cupy.empty((size, size), dtype=cupy.uint16)
    handle = cuda_device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    factors = np.array([1.0, 0.0], dtype=np.float32)  # host pointers: alpha, beta

    def gemm() -> None:
        cublas.gemmEx(
            handle, _CUBLAS_OP_N, _CUBLAS_OP_N, size, size, size, factors.ctypes.data,
            a.data.ptr, _CUDA_R_16BF, size, b.data.ptr, _CUDA_R_16BF, size, factors.ctypes.data + 4,
            c.data.ptr, _CUDA_R_16BF, size, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip

    return 2.0 * size**3 / median_ms(gemm) / 1e9


def copy_gbps(*, mib: int) -> float:
    """GB/s (bytes read + bytes written) of one device-to-device cudaMemcpyAsync of ``mib`` MiB,
    far beyond the L2 cache (50 MB on the H200)."""
    import cupy

    nbytes = mib * 2**20
    src = cupy.arange(nbytes // 4, dtype=cupy.uint32)
    dst = cupy.empty_like(src)
    return 2.0 * nbytes / median_ms(lambda: dst.data.copy_from_device_async(src.data, nbytes)) / 1e6


def measured(family: Callable[[], T], reference: Callable[[], float]) -> tuple[T, float | None]:
    """The family's values and its reference's, measured before and after them in this process.
    A failing reference leaves the family's own values (the ratios read n/a) and says why."""

    def reference_or_none() -> float | None:
        try:
            return reference()
        except (RuntimeError, ImportError, OSError) as error:  # CUDA and cuBLAS errors are RuntimeErrors
            print(f"fixed reference failed: {type(error).__name__}: {error}", file=sys.stderr)
            return None

    before = reference_or_none()
    values = family()
    after = reference_or_none()
    if before is None or after is None:
        return values, None
    return values, (before + after) / 2


def ratio(value: float | None, reference: float | None) -> float | None:
    """A throughput over its reference's; None where either is missing."""
    return value / reference if value and reference else None


class _RatioEntries:
    """Mixin: the family's entries (its ``params``: cupyflash's) over the fixed reference of the
    same run, unit "ratio" (higher is better): the series the regression gate judges."""

    def track_ratio(self, run: _FamilyRun, *combo: object) -> float | None:
        return ratio(run[0][combo], run[1])

    track_ratio.unit = "ratio"  # type: ignore[attr-defined]


class _PeerRatioEntries:
    """Mixin: cupyflash's default dispatch over each peer (its ``params``: the peers, then the
    family's shape parameters) in the same run -- one process, the same inputs, the interleaved
    timing -- unit "ratio": the speed claim beside cuDNN and FlashAttention-4 (None where the
    peer is not installed or refused the shape). Its first parameter is a peer's name, so the
    regression gate lists it and never gates it: a peer changes with its installed version."""

    def track_ratio_to_peer(self, run: _FamilyRun, peer: str, *shape: object) -> float | None:
        return ratio(run[0][("cupyflash", *shape)], run[0][(peer, *shape)])

    track_ratio_to_peer.unit = "ratio"  # type: ignore[attr-defined]


class _GemmEntry:
    """Mixin: the GEMM reference of the run, TFLOP/s."""

    def track_gemm_tflops(self, run: _FamilyRun) -> float | None:
        return run[1]

    track_gemm_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]


class _CopyEntry:
    """Mixin: the copy reference of the run, GB/s."""

    def track_copy_gbps(self, run: _FamilyRun) -> float | None:
        return run[1]

    track_copy_gbps.unit = "GB/s"  # type: ignore[attr-defined]
