"""GPU host path of the two baselines FA2 is measured against: ``algorithm="naive"`` and
``algorithm="fa1"``. They are there to be measured (docs/io_analysis.md), so they favour a
faithful HBM traffic over a lean host path: no plan cache, scratch allocated per call.

* naive -- standard attention as PyTorch's math path runs it: S = scale * Q K^T written to HBM
  by a cuBLAS GEMM in the input's 16-bit type, P = softmax(S) written by kernels_cu/naive.cu,
  O = P V by a second GEMM. The GEMMs read the caller's arrays in place through strided-batched
  cuBLAS calls (a (batch, head) grid whose strides do not collapse into one batch stride runs
  one call per head or per batch entry). S and P are [B, Hq, Nq, Nk]: O(N^2) memory. In float16
  a score beyond 65504 overflows S, as in PyTorch's math path.
* fa1 -- kernels_cu/fa1_fwd.cu, one CTA per (batch, head), with float32 scratch for the running
  (O, m, l) that crosses HBM at every outer step. Tiles from the paper's formula on the device's
  shared memory per block (``_dispatch.fa1_tiles``), or explicit ``block_r``/``block_c``.

Semantics are those of every algorithm: bottom-right causal, windows, softcap, GQA, any finite
scale, LSE. Work is queued on the caller's stream; nothing synchronises the device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _interop, _kernels
from ._dispatch import fa1_tiles
from ._specs import CUDA_ELEMENT_TYPES, FA1_HEAD_DIMS, Fa1FwdSpec, NaiveSoftmaxSpec
from ._validate import Problem

# cuBLAS enums (cublas_api.h / library_types.h).
_CUDA_DATA_TYPE = {"float16": 2, "bfloat16": 14}  # CUDA_R_16F, CUDA_R_16BF
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1

BASELINE_ALGORITHMS = ("fa1", "naive")
CUDA_ELEMENT_BYTES = 2  # float16 and bfloat16


class _RawStream:
    """A raw stream pointer in the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_cupy_streams: dict[int, Any] = {}


def _cupy_stream(ptr: int) -> Any:
    stream = _cupy_streams.get(ptr)
    if stream is None:
        import cupy

        stream = _cupy_streams[ptr] = cupy.cuda.Stream.from_external(_RawStream(ptr))
    return stream


def gpu_attention(
    kind: str,
    q: Any,
    k: Any,
    v: Any,
    device: int,
    problem: Problem,
    algorithm: str,
    *,
    block_r: int | None = None,
    block_c: int | None = None,
) -> tuple[Any, Any]:
    """(out, lse) of ``algorithm`` ("naive" or "fa1") on torch or CuPy GPU arrays, in the
    caller's library; ``block_r``/``block_c`` override FA1's tiles (the tile-size study)."""
    import cupy

    p = problem
    names = tuple(_dtype_name(kind, x) for x in (q, k, v))
    if not (names[0] == names[1] == names[2]):
        raise TypeError(f"q, k and v must have one dtype, got {names[0]}, {names[1]}, {names[2]}")
    dtype = names[0]
    if dtype not in CUDA_ELEMENT_TYPES:
        raise TypeError(f"the GPU kernels take {sorted(CUDA_ELEMENT_TYPES)}, got {dtype}")
    if algorithm == "fa1" and p.head_dim not in FA1_HEAD_DIMS:
        raise ValueError(f"algorithm='fa1' on the GPU supports head_dim in {FA1_HEAD_DIMS}, got {p.head_dim}")
    if algorithm == "fa1" and (p.batch > 65535 or p.heads_q > 65535):
        raise ValueError(f"algorithm='fa1' needs batch ({p.batch}) and heads ({p.heads_q}) <= 65535")
    if algorithm == "naive" and p.batch * p.heads_q * p.seqlen_q >= 2**31:
        raise ValueError("algorithm='naive' takes at most 2^31 - 1 rows of scores (batch * heads * seqlen_q)")
    if algorithm not in BASELINE_ALGORITHMS:
        raise ValueError(f"not a baseline algorithm: {algorithm!r}")
    from ._api import POISON_OUTPUTS, _device_max_smem, _softmax_factors

    if algorithm == "fa1":
        scale_log2, softcap_prescale, negate_q = _softmax_factors(p)
    else:
        scale_log2, softcap_prescale, negate_q = _naive_softmax_factors(p)
    stream_ptr = _interop.torch_current_stream(device) if kind == _interop.TORCH else None
    with cupy.cuda.Device(device):
        stream = cupy.cuda.get_current_stream() if stream_ptr is None else _cupy_stream(stream_ptr)
        with stream:
            if algorithm == "fa1" and negate_q:
                q = -q
            inputs = [q, k, v]
            for i, x in enumerate(inputs):  # copies stay referenced in `inputs` until the launch
                if not _interop.kernel_readable(_ptr(kind, x), x.shape, _strides(kind, x)):
                    inputs[i] = _interop.readable_copy(kind, x)
            out, lse = _empty_outputs(kind, q, p)
            if POISON_OUTPUTS:
                _fill(out, math.nan)
                _fill(lse, math.nan)
            if p.batch and p.heads_q and p.seqlen_q and p.seqlen_k == 0:
                _fill(out, 0.0)  # no key at all: O = 0, LSE = -inf (no kernel needed)
                _fill(lse, -math.inf)
            elif p.batch and p.heads_q and p.seqlen_q:
                axes = (0, 1, 2) if p.layout == "bshd" else (0, 2, 1)
                ptrs = [_ptr(kind, x) for x in inputs]
                strides = [_bsh_strides(_strides(kind, x), axes) for x in (*inputs, out)]
                params = _attn_params(p, ptrs, _ptr(kind, out), _ptr(kind, lse), strides, scale_log2, softcap_prescale)
                if algorithm == "fa1":
                    spec = _fa1_spec(dtype, p, _device_max_smem(device), block_r, block_c)
                    _run_fa1(spec, p, device, params, stream.ptr)
                else:
                    _run_naive(dtype, p, device, params, ptrs, strides, _ptr(kind, out), stream.ptr)
    return out, lse


def _naive_softmax_factors(p: Problem) -> tuple[float, float, bool]:
    """(softmax_scale_log2, softcap_prescale, negate_q) for the naive softmax: the GEMM already
    applied the scale (alpha), so the logits are S itself or softcap * tanh(S / softcap)."""
    from ._api import _MAX_SOFTCAP_PRESCALE, _ZERO_SCALE_SURROGATE

    log2e = 1.0 / math.log(2.0)
    if p.softcap > 0:
        multiplier = min(max(p.softcap, _ZERO_SCALE_SURROGATE), _MAX_SOFTCAP_PRESCALE)
        return multiplier * log2e, min(1.0 / p.softcap, _MAX_SOFTCAP_PRESCALE), False
    return log2e, 0.0, False


def _fa1_spec(dtype: str, p: Problem, max_smem: int, block_r: int | None, block_c: int | None) -> Fa1FwdSpec:
    formula_r, formula_c = fa1_tiles(p.head_dim, CUDA_ELEMENT_BYTES, max_smem)
    spec = Fa1FwdSpec(
        dtype, p.head_dim, block_r or formula_r, block_c or formula_c, p.causal_bound, p.local_bound, p.softcap > 0
    )
    if spec.smem_bytes > max_smem:
        raise ValueError(f"FA1 tiles B_r={spec.block_r}, B_c={spec.block_c} need {spec.smem_bytes} bytes of shared "
                         f"memory; the device has {max_smem} per block")  # fmt: skip
    return spec


def _run_fa1(spec: Fa1FwdSpec, p: Problem, device: int, params: tuple[int | float, ...], stream_ptr: int) -> None:
    import cupy

    kernel = _kernels.get_kernel(spec, device)
    o_state = cupy.empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim), dtype=cupy.float32)
    max_state = cupy.empty((p.batch, p.heads_q, p.seqlen_q), dtype=cupy.float32)
    sum_state = cupy.empty_like(max_state)
    grid = (p.heads_q, p.batch, 1)
    kernel.launch_with_buffers(
        grid, (spec.num_threads, 1, 1), spec.smem_bytes, stream_ptr, params, (o_state, max_state, sum_state)
    )


def _run_naive(
    dtype: str,
    p: Problem,
    device: int,
    params: tuple[int | float, ...],
    ptrs: list[int],
    strides: list[tuple[int, int, int, int]],
    out_ptr: int,
    stream_ptr: int,
) -> None:
    """The three passes: S = scale Q K^T (cuBLAS), P = softmax(S) (naive.cu), O = P V (cuBLAS)."""
    import cupy

    scores = cupy.empty((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), dtype=dtype)  # S, in HBM
    probs = cupy.empty_like(scores)  # P, in HBM
    group = p.heads_q // p.heads_kv
    sq, sk, sv, so = strides
    s_strides = (p.heads_q * p.seqlen_q * p.seqlen_k, p.seqlen_k, p.seqlen_q * p.seqlen_k)  # (batch, row, head)
    # Pass 1: S^T (col-major Nk x Nq) = K (op T) x Q^T, alpha = scale.
    for base, count, stride_of in _batching(p, group, (sq, sk, sv, so, (*s_strides, 1))):
        _gemm(
            dtype, _CUBLAS_OP_T, _CUBLAS_OP_N, p.seqlen_k, p.seqlen_q, p.head_dim, p.scale,
            (ptrs[1], sk, base(1), stride_of(1)), (ptrs[0], sq, base(0), stride_of(0)),
            (scores.data.ptr, s_strides, base(4), stride_of(4)), count,
        )  # fmt: skip
    # Pass 2: P = softmax(S), one CTA per row; the LSE on the side.
    spec = NaiveSoftmaxSpec(dtype, p.causal_bound, p.local_bound, p.softcap > 0)
    kernel = _kernels.get_kernel(spec, device)
    rows = p.batch * p.heads_q * p.seqlen_q
    kernel.launch_with_buffers((rows, 1, 1), (spec.num_threads, 1, 1), 0, stream_ptr, params, (scores, probs))
    # Pass 3: O^T (col-major d x Nq) = V^T x P^T.
    for base, count, stride_of in _batching(p, group, (sq, sk, sv, so, (*s_strides, 1))):
        _gemm(
            dtype, _CUBLAS_OP_N, _CUBLAS_OP_N, p.head_dim, p.seqlen_q, p.seqlen_k, 1.0,
            (ptrs[2], sv, base(2), stride_of(2)), (probs.data.ptr, s_strides, base(4), stride_of(4)),
            (out_ptr, so, base(3), stride_of(3)), count,
        )  # fmt: skip


def _batching(p: Problem, group: int, strides: tuple[Any, ...]) -> Any:
    """Strided-batched GEMM calls covering every (batch, head): yields (base, count, stride_of),
    base(t) = element offset of tensor t's first matrix in the call, stride_of(t) = its batch
    stride. Tensors: 0 q, 1 k, 2 v, 3 o, 4 scores/probs; K/V use head h // group."""

    def head_stride(t: int) -> int:
        return int(strides[t][2])

    def batch_stride(t: int) -> int:
        return int(strides[t][0])

    tensors = range(5)
    if p.heads_q == 1:  # one call over the batch
        yield (lambda t: 0), p.batch, batch_stride
    elif group == 1 and (p.batch == 1 or all(batch_stride(t) == p.heads_q * head_stride(t) for t in tensors)):
        # (batch, head) collapses into one batch axis of stride head_stride (bhsd contiguous).
        yield (lambda t: 0), p.batch * p.heads_q, head_stride
    elif group == 1 and p.batch < p.heads_q:
        for b in range(p.batch):  # one call per batch entry, batched over the heads
            yield (lambda t, b=b: b * batch_stride(t)), p.heads_q, head_stride
    else:
        for h in range(p.heads_q):  # one call per query head, batched over the batch
            yield (lambda t, h=h: (h // group if t in (1, 2) else h) * head_stride(t)), p.batch, batch_stride


def _gemm(
    dtype: str,
    trans_a: int,
    trans_b: int,
    m: int,
    n: int,
    k: int,
    alpha: float,
    a: tuple[int, Any, int, int],
    b: tuple[int, Any, int, int],
    c: tuple[int, Any, int, int],
    count: int,
) -> None:
    """One cublasGemmStridedBatchedEx in column-major terms. Each operand is (pointer, its
    (batch, row, head) element strides, element offset of the first matrix, batch stride);
    the leading dimension is the row stride (at least the matrix's inner size)."""
    from cupy.cuda import device as cuda_device
    from cupy_backends.cuda.libs import cublas

    type_id = _CUDA_DATA_TYPE[dtype]
    factors = np.array([alpha, 0.0], dtype=np.float32)  # host pointers: alpha, beta
    # Rows of each operand as stored column-major: op(A) is m x k, op(B) k x n, C m x n.
    stored_rows = (k if trans_a == _CUBLAS_OP_T else m, n if trans_b == _CUBLAS_OP_T else k, m)
    (pa, lda, sa), (pb, ldb, sb), (pc, ldc, sc) = (
        (ptr + CUDA_ELEMENT_BYTES * offset, max(int(strides[1]), rows), batch_stride)
        for (ptr, strides, offset, batch_stride), rows in zip((a, b, c), stored_rows)
    )
    cublas.gemmStridedBatchedEx(
        cuda_device.get_cublas_handle(), trans_a, trans_b, m, n, k,
        factors.ctypes.data, pa, type_id, lda, sa, pb, type_id, ldb, sb,
        factors.ctypes.data + 4, pc, type_id, ldc, sc, count, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


def _attn_params(
    p: Problem,
    ptrs: list[int],
    out_ptr: int,
    lse_ptr: int,
    strides: list[tuple[int, int, int, int]],
    scale_log2: float,
    softcap_prescale: float,
) -> tuple[int | float, ...]:
    """AttnParams field values, in field order (cupyflash/_params.py)."""
    sq, sk, sv, so = strides
    return (
        *ptrs, out_ptr, lse_ptr, 0, 0,
        *sq[:3], *sk[:3], *sv[:3], *so[:3],
        p.heads_q * p.seqlen_q, p.seqlen_q,
        p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.heads_q // p.heads_kv,
        p.window_left, p.window_right, scale_log2, softcap_prescale,
    )  # fmt: skip


def _bsh_strides(strides: tuple[int, ...], axes: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """(batch, row, head, d) element strides of a 4-D array whose axes are ``axes`` + d."""
    return strides[axes[0]], strides[axes[1]], strides[axes[2]], strides[3]


def _dtype_name(kind: str, x: Any) -> str:
    return str(x.dtype).removeprefix("torch.") if kind == _interop.TORCH else str(x.dtype.name)


def _ptr(kind: str, x: Any) -> int:
    return int(x.data_ptr()) if kind == _interop.TORCH else int(x.data.ptr)


def _strides(kind: str, x: Any) -> tuple[int, ...]:
    return tuple(x.stride()) if kind == _interop.TORCH else _interop.element_strides(x)


def _empty_outputs(kind: str, q: Any, p: Problem) -> tuple[Any, Any]:
    lse_shape = (p.batch, p.heads_q, p.seqlen_q)
    if kind == _interop.TORCH:
        import torch

        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    import cupy

    return cupy.empty(q.shape, dtype=q.dtype), cupy.empty(lse_shape, dtype=cupy.float32)


def _fill(x: Any, value: float) -> None:
    if hasattr(x, "fill_"):
        x.fill_(value)
    else:
        x.fill(value)
