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
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _device, _interop
from ._dispatch import fa1_tiles
from ._interop import ArrayLib
from ._params import PARAMS_STRUCTS
from ._plan.common import (
    LAYOUT_AXES,
    MAX_SOFTCAP_PRESCALE,
    STRIDE_NAMES,
    ZERO_SCALE_SURROGATE,
    attn_fields,
    check_grid,
    contiguous_strides,
    softmax_factors,
    tile_operand,
)
from ._plan.model import KernelStep, Launch, Output, Temporary
from ._specs import FA1_HEAD_DIMS, Fa1FwdSpec, NaiveSoftmaxSpec
from ._validate import Problem

# cuBLAS enums (cublas_api.h / library_types.h).
_CUDA_DATA_TYPE = {"float16": 2, "bfloat16": 14}  # CUDA_R_16F, CUDA_R_16BF
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
CUDA_ELEMENT_BYTES = 2  # float16 and bfloat16


def plan_baseline(
    p: Problem,
    dtype: str,
    device: _device.DeviceInfo,
    algorithm: str,
    *,
    block_r: int | None = None,
    block_c: int | None = None,
) -> Launch:
    """``algorithm="fa1"`` or ``"naive"`` on the GPU; ``block_r``/``block_c`` override FA1's
    tiles (the tile-size study)."""
    if algorithm == "fa1":
        if p.head_dim not in FA1_HEAD_DIMS:
            raise ValueError(f"algorithm='fa1' on the GPU supports head_dim in {FA1_HEAD_DIMS}, got {p.head_dim}")
        check_grid(p.batch, p.heads_q)
        scale_log2, prescale, negate_q = softmax_factors(p)
    else:
        if p.batch * p.heads_q * p.seqlen_q >= 2**31:
            raise ValueError("algorithm='naive' takes at most 2^31 - 1 rows of scores (batch * heads * seqlen_q)")
        scale_log2, prescale, negate_q = _naive_softmax_factors(p)
    axes = LAYOUT_AXES[p.layout]
    q_shape = (p.batch, p.seqlen_q, p.heads_q, p.head_dim)
    if p.layout == "bhsd":
        q_shape = (p.batch, p.heads_q, p.seqlen_q, p.head_dim)
    out_strides = contiguous_strides(q_shape)
    params = PARAMS_STRUCTS["AttnParams"].template(
        **attn_fields(p, (p.seqlen_q, p.seqlen_k), scale_log2, prescale),
        **{f"o_{s}_stride": out_strides[a] for s, a in zip(STRIDE_NAMES, axes, strict=True)},
        lse_batch_stride=p.heads_q * p.seqlen_q, lse_head_stride=p.seqlen_q,
    )  # fmt: skip
    operands = (
        tile_operand(params, "q", axes, negate=negate_q),
        tile_operand(params, "k", axes),
        tile_operand(params, "v", axes),
    )
    lse_shape = (p.batch, p.heads_q, p.seqlen_q)
    has_rows = p.batch > 0 and p.heads_q > 0 and p.seqlen_q > 0
    fill = None if has_rows and p.seqlen_k else 0.0  # no key at all: O = 0, LSE = -inf, no kernel
    outputs: tuple[Output, ...] = (
        Output("out", q_shape, dtype, params.slot("o_ptr"), fill=fill),
        Output("lse", lse_shape, "float32", params.slot("lse_ptr"), fill=None if fill is None else -math.inf),
    )
    if fill is not None:
        return Launch(params, operands, outputs)
    if algorithm == "fa1":
        spec = _fa1_spec(dtype, p, device.max_smem_per_block, block_r, block_c)
        state = (p.batch, p.heads_q, p.seqlen_q)
        temporaries: tuple[Temporary, ...] = (
            Temporary("o_state", (*state, p.head_dim), "float32"),
            Temporary("max_state", state, "float32"),
            Temporary("sum_state", state, "float32"),
        )
        step = KernelStep(spec, (p.heads_q, p.batch, 1), (spec.num_threads, 1, 1), spec.smem_bytes,
                          buffers=("o_state", "max_state", "sum_state"))  # fmt: skip
        return Launch(params, operands, outputs, (step,), temporaries)
    # naive: S = scale Q K^T (cuBLAS), P = softmax(S) (naive.cu), O = P V (cuBLAS); S and P in HBM.
    softmax = NaiveSoftmaxSpec(dtype, p.causal_bound, p.local_bound, p.softcap > 0)
    scores = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
    rows = p.batch * p.heads_q * p.seqlen_q
    steps = (
        GemmStep("qk", p, dtype),
        KernelStep(softmax, (rows, 1, 1), (softmax.num_threads, 1, 1), 0, buffers=("scores", "probs")),
        GemmStep("pv", p, dtype),
    )
    temporaries = (Temporary("scores", scores, dtype), Temporary("probs", scores, dtype))  # S, P in HBM
    return Launch(params, operands, outputs, steps, temporaries)


def _naive_softmax_factors(p: Problem) -> tuple[float, float, bool]:
    """(softmax_scale_log2, softcap_prescale, negate_q) for the naive softmax: the GEMM already
    applied the scale (alpha), so the logits are S itself or softcap * tanh(S / softcap)."""
    log2e = 1.0 / math.log(2.0)
    if p.softcap > 0:
        multiplier = min(max(p.softcap, ZERO_SCALE_SURROGATE), MAX_SOFTCAP_PRESCALE)
        return multiplier * log2e, min(1.0 / p.softcap, MAX_SOFTCAP_PRESCALE), False
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


@dataclass(frozen=True)
class GemmStep:
    """One of the naive baseline's GEMMs, as cuBLAS strided-batched calls over every (batch,
    head): "qk" writes S^T (col-major Nk x Nq) = K (op T) x Q^T with alpha = scale; "pv" writes
    O^T (col-major d x Nq) = V^T x P^T. The operands are read in place through their strides (a
    (batch, head) grid whose strides do not collapse into one batch stride runs one call per
    head or per batch entry)."""

    which: str
    p: Problem
    dtype: str

    def execute(
        self, lib: ArrayLib, device: int, stream: int, launch: Launch, bound: list[Any], outputs: dict[str, Any],
        temporaries: dict[str, Any],
    ) -> None:  # fmt: skip
        p = self.p
        axes = LAYOUT_AXES[p.layout]

        def bsh(strides: tuple[int, ...]) -> tuple[int, int, int]:
            return strides[axes[0]], strides[axes[1]], strides[axes[2]]

        (q_ptr, sq), (k_ptr, sk), (v_ptr, sv) = (bound[launch.operand_index[n]] for n in ("q", "k", "v"))
        out = outputs["out"]
        so = bsh(lib.strides(out))
        s_strides = (p.heads_q * p.seqlen_q * p.seqlen_k, p.seqlen_k, p.seqlen_q * p.seqlen_k)  # (batch, row, head)
        strides = (bsh(sq), bsh(sk), bsh(sv), so, s_strides)
        group = p.heads_q // p.heads_kv
        for base, count, stride_of in _batching(p, group, strides):
            if self.which == "qk":
                s_ptr = lib.ptr(temporaries["scores"])
                _gemm(
                    stream, self.dtype, _CUBLAS_OP_T, _CUBLAS_OP_N, p.seqlen_k, p.seqlen_q, p.head_dim, p.scale,
                    (k_ptr, strides[1], base(1), stride_of(1)), (q_ptr, strides[0], base(0), stride_of(0)),
                    (s_ptr, s_strides, base(4), stride_of(4)), count,
                )  # fmt: skip
            else:
                p_ptr = lib.ptr(temporaries["probs"])
                _gemm(
                    stream, self.dtype, _CUBLAS_OP_N, _CUBLAS_OP_N, p.head_dim, p.seqlen_q, p.seqlen_k, 1.0,
                    (v_ptr, strides[2], base(2), stride_of(2)), (p_ptr, s_strides, base(4), stride_of(4)),
                    (lib.ptr(out), so, base(3), stride_of(3)), count,
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
    stream: int,
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
    """One cublasGemmStridedBatchedEx in column-major terms on ``stream``. Each operand is
    (pointer, its (batch, row, head) element strides, element offset of the first matrix, batch
    stride); the leading dimension is the row stride (at least the matrix's inner size)."""
    from cupy.cuda import device as cuda_device
    from cupy_backends.cuda.libs import cublas

    handle = cuda_device.get_cublas_handle()
    cublas.setStream(handle, stream)
    type_id = _CUDA_DATA_TYPE[dtype]
    factors = np.array([alpha, 0.0], dtype=np.float32)  # host pointers: alpha, beta
    # Rows of each operand as stored column-major: op(A) is m x k, op(B) k x n, C m x n.
    stored_rows = (k if trans_a == _CUBLAS_OP_T else m, n if trans_b == _CUBLAS_OP_T else k, m)
    (pa, lda, sa), (pb, ldb, sb), (pc, ldc, sc) = (
        (ptr + CUDA_ELEMENT_BYTES * offset, max(int(strides[1]), rows), batch_stride)
        for (ptr, strides, offset, batch_stride), rows in zip((a, b, c), stored_rows)
    )
    cublas.gemmStridedBatchedEx(
        handle, trans_a, trans_b, m, n, k,
        factors.ctypes.data, pa, type_id, lda, sa, pb, type_id, ldb, sb,
        factors.ctypes.data + 4, pc, type_id, ldc, sc, count, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


def fa1_attention(
    q: Any, k: Any, v: Any, *, block_r: int, block_c: int, causal: bool = False, scale: float | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str = "bshd",
) -> tuple[Any, Any]:  # fmt: skip
    """(out, lse) of the FA1 kernel with explicit tiles B_r, B_c (the IO study's tile sweep), on
    GPU arrays, through the same pipeline as ``attention(algorithm="fa1")``."""
    from . import _launch, _plan
    from ._validate import attention_problem

    found = _interop.gpu_arrays(("q", "k", "v"), (q, k, v))
    if found is None:
        raise TypeError("fa1_attention runs on GPU arrays")
    lib, device, (q, k, v) = found
    p = attention_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), causal=causal, scale=scale, window=window, softcap=softcap,
        layout=layout,
    )  # fmt: skip
    dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
    launch = plan_baseline(p, dtype, _device.device_info(device), "fa1", block_r=block_r, block_c=block_c)
    return _launch.run(launch, lib, device, {"q": q, "k": k, "v": v}, True)
