"""The public functions. ``attention`` validates, picks the path for the caller's arrays (CuPy,
PyTorch, other DLPack GPU arrays, or host arrays of any array-API namespace), and on the GPU
packs one ``AttnParams`` and launches one kernel on the caller's stream."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, overload

from . import _interop, _kernels, _tma, _workspace
from ._dispatch import MaskFlags, fa2_fwd_spec, fa3_fwd_spec
from ._specs import CUDA_ELEMENT_TYPES, FA2_HEAD_DIMS, HOPPER_ARCH, Fa2FwdSpec, Fa3FwdSpec
from ._validate import Problem, attention_problem, check_algorithm, check_cu_seqlens_values, varlen_problem

# "fa2": the mma.sync kernel (any GPU from sm_80); "fa3": the Hopper kernel (wgmma + TMA, sm_90);
# "auto": fa3 where it applies (Hopper, head_dim 64/128/256; packed sequences take its _varlen
# variants), else fa2.
# "fa1" and "naive": the baselines of docs/io_analysis.md.
GPU_ALGORITHMS = ("auto", "fa2", "fa3", "fa1", "naive")
VARLEN_ALGORITHMS = ("auto", "fa2", "fa3")

#: Fill every GPU output with NaN before the launch (tests set it: a value the kernel fails to
#: write then shows up as NaN instead of as stale memory that happens to look right).
POISON_OUTPUTS = False

# The smallest softmax multiplier the kernels run with (scale 0, tiny scales or softcaps):
# exp2(x * 1e-30 - m * 1e-30) rounds to exactly 1 in float32 for any 16-bit score, so the result
# is the uniform average, as the limit requires; 0 itself would turn masked -inf * 0 into NaN.
_ZERO_SCALE_SURROGATE = 1e-30
# The kernels scale float32 scores: |scale| <= 1e6 keeps |q.k| * scale * log2(e) finite for every
# float16 input (|q.k| <= 65504^2 * 256 ~ 1.1e12), where a larger one could overflow silently.
_MAX_GPU_SCALE = 1e6
# tanh(s * prescale) saturates long before float32 runs out; clamping keeps the pack in range.
_MAX_SOFTCAP_PRESCALE = 1e30


@overload
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    layout: str = ...,
    algorithm: str = ...,
    return_lse: Literal[False] = ...,
) -> Any: ...
@overload
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    layout: str = ...,
    algorithm: str = ...,
    return_lse: Literal[True],
) -> tuple[Any, Any]: ...
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    layout: str = "bshd",
    algorithm: str = "auto",
    return_lse: bool = False,
) -> Any:
    """Exact attention ``softmax(scale * q @ k^T + mask) @ v``.

    Parameters
    ----------
    q : array, ``(B, Nq, Hq, d)`` for ``layout="bshd"`` or ``(B, Hq, Nq, d)`` for ``"bhsd"``
        CuPy array, PyTorch tensor, any DLPack GPU array (JAX ...) or a host array of any
        array-API namespace (NumPy, array_api_strict, PyTorch CPU).
    k, v : arrays, ``(B, Nk, Hkv, d)`` (or ``(B, Hkv, Nk, d)``), same library, device and dtype
        as ``q``. ``Hq % Hkv == 0``: query head ``h`` reads key/value head ``h // (Hq // Hkv)``
        (GQA; ``Hkv = 1`` is MQA).
    causal : bool
        Bottom-right aligned, as flash-attn >= 2.1: query ``i`` sees key ``j`` iff
        ``j <= i + Nk - Nq``. For Nq = 2, Nk = 5 (1 = visible)::

            1 1 1 1 0
            1 1 1 1 1

        A query row that sees no key outputs 0 and its LSE is ``-inf``.
    scale : float, optional
        Defaults to ``1 / sqrt(d)``. Any finite value.
    window : (left, right)
        Sliding window: query ``i`` sees keys ``i + Nk - Nq - left .. i + Nk - Nq + right``;
        ``-1`` = unbounded. ``causal=True`` is ``right = 0``.
    softcap : float
        If > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    layout : {"bshd", "bhsd"}
    algorithm : {"auto", "fa2", "fa3", "fa1", "naive", "decode"}
        On the GPU (float16/bfloat16): ``"fa2"``, the mma.sync kernel (head_dim 32, 64, 96, 128,
        192, 256); ``"fa3"``, the Hopper kernel (wgmma + TMA; sm_90, head_dim 64, 128, 256);
        ``"auto"`` picks fa3 where it applies, else fa2.
        ``"fa1"`` (FlashAttention-1's loop order, head_dim 64, 128, 256, 512) and ``"naive"``
        (S and P materialised in HBM, any head_dim) are the baselines of docs/io_analysis.md.
        On the host every algorithm runs through ``cupyflash.xp_impl``.
    return_lse : bool
        Also return the log-sum-exp of each row, float32, natural log, ``(B, Hq, Nq)``.

    Returns
    -------
    out : array like ``q`` (same library, device, dtype and layout; a fresh contiguous array)
    lse : float32 array ``(B, Hq, Nq)``, when ``return_lse``

    Notes
    -----
    GPU inputs need a unit stride on ``d`` and 16-byte aligned strides; other layouts are copied
    to a contiguous array first (in the caller's library, on its stream). GPU work is queued on
    the caller's stream (CuPy's current stream, or PyTorch's current stream for tensors) and
    nothing synchronises the device.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 5, 2, 16), dtype=np.float32)
    >>> k = v = rng.standard_normal((1, 7, 1, 16), dtype=np.float32)
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 16), (1, 2, 5))
    """
    options = (causal, scale, window, softcap, layout, algorithm)
    if algorithm == "fa1" or algorithm == "naive":
        return _baseline_attention(q, k, v, options, return_lse)
    kind = _interop.same_array_kind(q, k, v)
    if kind == _interop.TORCH:
        device = q.get_device()
        if device >= 0 and k.get_device() == device and v.get_device() == device:
            return _torch_attention(q, k, v, device, options, return_lse)
    elif kind == _interop.CUPY:
        device = q.data.device_id
        if k.data.device_id == device and v.data.device_id == device:
            return _cupy_attention(q, k, v, device, options, return_lse)

    # Everything else, and every mismatch, goes through the full checks with their messages.
    algorithm = check_algorithm(algorithm)
    kind, device = _interop.common_placement(q=q, k=k, v=v)
    problem = attention_problem(
        q.shape, k.shape, v.shape, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout
    )
    if kind == _interop.HOST:
        return _host_attention(q, k, v, problem, algorithm, return_lse)
    return _dlpack_attention(q, k, v, options, return_lse)


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    algorithm: str = "auto",
) -> Any:
    """Attention over a batch of sequences of different lengths packed end to end, as
    flash-attn's ``flash_attn_varlen_func``.

    Parameters
    ----------
    q : array ``(total_q, Hq, d)``; sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    k, v : arrays ``(total_k, Hkv, d)``, split by ``cu_seqlens_k``
    cu_seqlens_q, cu_seqlens_k : int32 arrays ``(batch + 1,)``, starting at 0, non-decreasing,
        on the same device as ``q``
    max_seqlen_q, max_seqlen_k : int
        The longest query / key sequence (they size the grid).
    causal, scale, window, softcap : as in :func:`attention`, per sequence (bottom-right causal
        within each sequence).
    return_lse : bool
        Also return the float32 LSE, shape ``(Hq, total_q)``.
    algorithm : {"auto", "fa2", "fa3"}
        The GPU kernel. "auto" is the Hopper kernel where it applies (sm_90, head_dim 64/128/256),
        else the mma.sync FA2 kernel; "fa2" and "fa3" force one (as :func:`attention`). On the
        host every choice runs ``cupyflash.xp_impl``'s FA2.

    Notes
    -----
    On the GPU the offsets are not read back to the host (that would synchronise the device on
    every call): they are trusted like flash-attn's, and the kernel clamps them into the packed
    tensors so that wrong offsets can never read or write out of bounds. Host arrays are checked.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> q = k = v = np.ones((7, 2, 16), dtype=np.float32)
    >>> cu = np.array([0, 3, 7], dtype=np.int32)
    >>> cupyflash.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).shape
    (7, 2, 16)
    """
    if algorithm not in VARLEN_ALGORITHMS:
        raise ValueError(f"attention_varlen's algorithm must be one of {VARLEN_ALGORITHMS}, got {algorithm!r}")
    kind, device = _interop.common_placement(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    problem = varlen_problem(
        q.shape, k.shape, v.shape, cu_seqlens_q.shape, cu_seqlens_k.shape, max_seqlen_q, max_seqlen_k,
        causal=causal, scale=scale, window=window, softcap=softcap,
    )  # fmt: skip
    if kind == _interop.HOST:
        return _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, problem, return_lse)
    if kind == _interop.DLPACK:
        import cupy
        from array_api_compat import array_namespace

        qc, kc, vc, cu_qc, cu_kc = (cupy.from_dlpack(x) for x in (q, k, v, cu_seqlens_q, cu_seqlens_k))
        out, lse = _gpu_varlen(_interop.CUPY, qc, kc, vc, cu_qc, cu_kc, problem, device, True, algorithm)
        xp = array_namespace(q)
        return (xp.from_dlpack(out), xp.from_dlpack(lse)) if return_lse else xp.from_dlpack(out)
    out, lse = _gpu_varlen(kind, q, k, v, cu_seqlens_q, cu_seqlens_k, problem, device, return_lse, algorithm)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Host arrays: the array-API algorithms.
# ---------------------------------------------------------------------------------------------
def _host_attention(q: Any, k: Any, v: Any, problem: Problem, algorithm: str, return_lse: bool) -> Any:
    from array_api_compat import array_namespace

    from . import xp_impl

    xp = array_namespace(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # fa3 is FA2's algorithm on Hopper's instructions: on the host both are xp_impl's fa2.
    host_algorithm = "fa2" if algorithm in ("auto", "fa3") else algorithm
    out, lse = xp_impl.attention(xp, q, k, v, problem, algorithm=host_algorithm)
    return (out, lse) if return_lse else out


def _host_varlen(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, problem: Problem, return_lse: bool) -> Any:
    """One dense attention per sequence, in the arrays' own namespace."""
    from array_api_compat import array_namespace

    xp = array_namespace(q, k, v)
    check_cu_seqlens_values(cu_q, cu_k, q.shape[0], k.shape[0], problem.seqlen_q, problem.seqlen_k)
    outs, lses = [], []
    for b in range(problem.batch):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        seq = [xp.expand_dims(x, axis=0) for x in (q[q0:q1, ...], k[k0:k1, ...], v[k0:k1, ...])]
        window = (problem.window_left, problem.window_right)
        out, lse = attention(*seq, scale=problem.scale, window=window, softcap=problem.softcap, return_lse=True)
        outs.append(out[0, ...])
        lses.append(lse[0, ...])
    out = xp.concat(outs, axis=0) if outs else xp.zeros_like(q)
    lse = xp.concat(lses, axis=1) if lses else xp.zeros((problem.heads_q, q.shape[0]), dtype=xp.float32)
    pad = q.shape[0] - int(cu_q[-1])  # rows after the last sequence: zero, LSE -inf
    if pad > 0:
        out = xp.concat([out, xp.zeros((pad, *q.shape[1:]), dtype=q.dtype)], axis=0)
        lse = xp.concat([lse, xp.full((problem.heads_q, pad), -math.inf, dtype=xp.float32)], axis=1)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# GPU. Everything that depends only on shapes, dtypes, device and options -- validation, the
# variant, its compiled kernel, grid, the fixed fields of AttnParams -- is a _GpuPlan, cached
# per call signature. A call then reads pointers and strides, allocates the output, packs the
# params and launches: the host time of a decode step is a few dict lookups and one launch.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _GpuPlan:
    kernel: _kernels.CompiledKernel | None  # None when the output is empty (nothing to launch)
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    smem: int
    negate_q: bool  # a negative scale runs as |scale| on -q
    # Positions of the (batch, row, head) strides among an input's strides; -1 picks the 0 that
    # _launch appends (packed varlen tensors have no batch axis).
    axes: tuple[int, int, int]
    lse_shape: tuple[int, ...]
    tail: tuple[int | float, ...]  # AttnParams fields from the o strides on
    tma: _TmaPlan | None = None  # the Hopper kernel's tensor-map shapes


@dataclass(frozen=True, slots=True)
class _TmaPlan:
    """What the three tensor maps of a Hopper launch need besides the pointers and strides."""

    dtype: str
    q_dims: tuple[int, int, int, int]  # (d, rows, heads, batch), innermost first
    kv_dims: tuple[int, int, int, int]
    q_box_rows: int
    kv_box_rows: int
    dynamic: bool  # the dynamic schedule: the stream's tile counters go with the launch
    num_m_blocks: int  # query blocks per (batch, head), of the longest sequence when varlen


_plans: dict[tuple[Any, ...], _GpuPlan] = {}
_MAX_PLANS = 4096  # a long-running process with endlessly new shapes starts over, not grows


def _device_max_smem(device: int) -> int:
    return _interop.device_attribute(device, "MaxSharedMemoryPerBlockOptin")


def _check_gpu_dtypes(q_dtype: str, k_dtype: str, v_dtype: str, head_dim: int) -> None:
    if not (q_dtype == k_dtype == v_dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q_dtype}, {k_dtype}, {v_dtype}")
    if q_dtype not in CUDA_ELEMENT_TYPES:
        raise TypeError(f"the GPU kernels take {sorted(CUDA_ELEMENT_TYPES)}, got {q_dtype}")
    if head_dim not in FA2_HEAD_DIMS:
        raise ValueError(f"the GPU kernels support head_dim in {FA2_HEAD_DIMS}, got {head_dim}")


def _softmax_factors(problem: Problem) -> tuple[float, float, bool]:
    """(softmax_scale_log2, softcap_prescale, negate_q) for AttnParams.

    The kernel keeps its running max on raw scores, which needs a positive float32 multiplier:
    a negative scale runs as |scale| on -q, and a multiplier under 1e-30 (scale 0, or a tiny
    softcap) runs as 1e-30, where every exp2 already rounds to exactly 1 (uniform attention).
    """
    log2e = 1.0 / math.log(2.0)
    if problem.softcap > 0:
        prescale = max(-_MAX_SOFTCAP_PRESCALE, min(_MAX_SOFTCAP_PRESCALE, problem.scale / problem.softcap))
        multiplier = min(max(problem.softcap, _ZERO_SCALE_SURROGATE), _MAX_SOFTCAP_PRESCALE)
        return multiplier * log2e, prescale, False
    if abs(problem.scale) > _MAX_GPU_SCALE:
        raise ValueError(f"the GPU kernels take |scale| <= {_MAX_GPU_SCALE:g} (float32 scores), got {problem.scale}")
    return max(abs(problem.scale), _ZERO_SCALE_SURROGATE) * log2e, 0.0, problem.scale < 0


def _make_plan(
    shapes: tuple[Any, Any, Any], dtypes: tuple[str, str, str], device: int, options: tuple[Any, ...]
) -> _GpuPlan:
    causal, scale, window, softcap, layout, algorithm = options
    check_algorithm(algorithm)
    p = attention_problem(*shapes, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout)
    if algorithm not in GPU_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} has no GPU kernel yet; on the GPU use one of {GPU_ALGORITHMS}")
    axes = (0, 1, 2) if layout == "bshd" else (0, 2, 1)
    b, s0, s1, d = shapes[0]
    contiguous = (s0 * s1 * d, s1 * d, d)
    return _build_plan(
        p, dtypes, device, algorithm=algorithm, axes=axes,
        o_strides=(contiguous[axes[0]], contiguous[axes[1]], contiguous[axes[2]]),
        lse_shape=(p.batch, p.heads_q, p.seqlen_q), lse_strides=(p.heads_q * p.seqlen_q, p.seqlen_q),
        param_seqlens=(p.seqlen_q, p.seqlen_k),
    )  # fmt: skip


def _build_plan(
    p: Problem,
    dtypes: tuple[str, str, str],
    device: int,
    *,
    algorithm: str = "fa2",
    axes: tuple[int, int, int],
    o_strides: tuple[int, int, int],
    lse_shape: tuple[int, ...],
    lse_strides: tuple[int, int],
    param_seqlens: tuple[int, int],
) -> _GpuPlan:
    _check_gpu_dtypes(*dtypes, p.head_dim)
    if p.batch > 65535 or p.heads_q > 65535:
        raise ValueError(f"batch ({p.batch}) and heads ({p.heads_q}) must be <= 65535 on the GPU")
    scale_log2, softcap_prescale, negate_q = _softmax_factors(p)
    kernel, grid, threads, smem, tma = None, (0, 0, 0), (0, 0, 0), 0, None
    if p.batch and p.seqlen_q and p.heads_q:
        spec = _forward_spec(p, dtypes[0], device, algorithm, packed=axes[0] < 0)
        kernel = _kernels.get_kernel(spec, device)
        threads, smem = (spec.num_threads, 1, 1), spec.smem_bytes
        if isinstance(spec, Fa2FwdSpec):
            grid = (-(-p.seqlen_q // spec.tile.block_m), p.batch, p.heads_q)
        else:  # uniform tiles: one persistent CTA per SM walks them; uneven: one CTA per tile
            tiles = -(-p.seqlen_q // spec.block_m) * p.batch * p.heads_q
            if tiles >= 2**31:
                raise ValueError(f"{tiles} query tiles exceed the kernel's 32-bit tile counter")
            grid = (
                min(tiles, _interop.device_attribute(device, "MultiProcessorCount")) if spec.persistent else tiles,
                1,
                1,
            )
            # Packed sequences are one batch of param_seqlens (the packed totals) rows; a padded
            # batch has p.batch of seqlen rows each. Only a _varlen variant reads cu_seqlens.
            d, packed = p.head_dim, axes[0] < 0
            assert spec.varlen == packed, f"{spec.name} on {'packed' if packed else 'padded'} inputs"
            rows_q, rows_k = param_seqlens if packed else (p.seqlen_q, p.seqlen_k)
            batches = 1 if packed else p.batch
            tma = _TmaPlan(
                dtypes[0], (d, rows_q, p.heads_q, batches), (d, rows_k, p.heads_kv, batches),
                spec.block_m, spec.block_n, spec.tile.dynamic, -(-p.seqlen_q // spec.block_m),
            )  # fmt: skip
    tail = (
        *o_strides, *lse_strides,
        p.batch, *param_seqlens, p.heads_q, p.heads_kv, p.heads_q // p.heads_kv,
        p.window_left, p.window_right, scale_log2, softcap_prescale,
    )  # fmt: skip
    return _GpuPlan(
        kernel=kernel,
        grid=grid,
        threads=threads,
        smem=smem,
        negate_q=negate_q,
        axes=axes,
        lse_shape=lse_shape,
        tail=tail,
        tma=tma,
    )


def _forward_spec(p: Problem, dtype: str, device: int, algorithm: str, packed: bool) -> Fa2FwdSpec | Fa3FwdSpec:
    """fa3 on Hopper where it applies (and fits), else the mma.sync FA2 kernel; ``packed``
    (varlen) picks the fa3 variant that reads each sequence's rows from cu_seqlens."""
    flags = MaskFlags(p.causal_bound, p.local_bound, p.softcap > 0)
    max_smem = _device_max_smem(device)
    if algorithm in ("fa3", "auto"):
        hopper = _kernels.device_arch(device) == HOPPER_ARCH
        spec = fa3_fwd_spec(dtype, p.head_dim, flags, p.seqlen_k, packed) if hopper else None
        if spec is not None and spec.smem_bytes <= max_smem:
            return spec
        if algorithm == "fa3":
            raise ValueError(
                "algorithm='fa3' (wgmma + TMA) needs a Hopper GPU (sm_90) and head_dim in (64, 128, 256); this "
                f"call has head_dim={p.head_dim} on {_kernels.device_arch(device)}: use algorithm='fa2' or 'auto'"
            )
    return fa2_fwd_spec(dtype, p.head_dim, flags, max_smem)


def _plan_for(
    shapes: tuple[Any, Any, Any], dtypes: tuple[Any, Any, Any], names: Any, device: int, options: tuple[Any, ...]
) -> _GpuPlan:
    key = (*shapes, *dtypes, device, options)
    try:
        return _plans[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable option (a window given as a list): plan without caching
        return _make_plan(shapes, names(), device, options)
    plan = _make_plan(shapes, names(), device, options)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


def _launch(
    plan: _GpuPlan,
    ptrs: tuple[int, int, int],
    strides: tuple[Any, Any, Any],
    out_ptr: int,
    lse_ptr: int,
    stream_ptr: int,
    kind: str,
    device: int,
    cu_seqlens: tuple[int, int] = (0, 0),
) -> None:
    assert plan.kernel is not None
    b, r, h = plan.axes
    qs, ks, vs = ((*x, 0) for x in strides)
    maps: bytes | None = None
    extra: tuple[int, ...] = ()
    if plan.tma is not None:
        t = plan.tma
        maps = (
            _tma.tile_map(t.dtype, ptrs[0], t.q_dims, (qs[r], qs[h], qs[b]), t.q_box_rows)
            + _tma.tile_map(t.dtype, ptrs[1], t.kv_dims, (ks[r], ks[h], ks[b]), t.kv_box_rows)
            + _tma.tile_map(t.dtype, ptrs[2], t.kv_dims, (vs[r], vs[h], vs[b]), t.kv_box_rows)
        )
        # Fa3Params ends with the tile counters (the stream's pair, 0 between launches) and the
        # query blocks per (batch, head).
        counters = _workspace.stream_scratch(kind, device, stream_ptr, 8, 0)[0] if t.dynamic else 0
        extra = (counters, t.num_m_blocks)
    plan.kernel.launch(
        plan.grid, plan.threads, plan.smem, stream_ptr,
        *ptrs, out_ptr, lse_ptr, *cu_seqlens,
        qs[b], qs[r], qs[h], ks[b], ks[r], ks[h], vs[b], vs[r], vs[h],
        *plan.tail, *extra, tma_maps=maps,
    )  # fmt: skip


def _torch_attention(q: Any, k: Any, v: Any, device: int, options: tuple[Any, ...], return_lse: bool) -> Any:
    torch = _interop.torch_module()

    names = lambda: tuple(str(x.dtype).removeprefix("torch.") for x in (q, k, v))  # noqa: E731
    plan = _plan_for((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), names, device, options)
    if plan.negate_q:
        q = -q
    inputs = [q, k, v]
    for i, x in enumerate(inputs):  # copies stay referenced in `inputs` until the launch
        if not _interop.kernel_readable(x.data_ptr(), x.shape, x.stride()):
            inputs[i] = _interop.readable_copy(_interop.TORCH, x)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    if POISON_OUTPUTS:
        out.fill_(math.nan)
        if lse is not None:
            lse.fill_(math.nan)
    if plan.kernel is not None:
        ptrs = (inputs[0].data_ptr(), inputs[1].data_ptr(), inputs[2].data_ptr())
        strides = (inputs[0].stride(), inputs[1].stride(), inputs[2].stride())
        lse_ptr = 0 if lse is None else lse.data_ptr()
        stream = _interop.torch_current_stream(device)
        if _current_device() == device:
            _launch(plan, ptrs, strides, out.data_ptr(), lse_ptr, stream, _interop.TORCH, device)
        else:
            import cupy

            with cupy.cuda.Device(device):
                _launch(plan, ptrs, strides, out.data_ptr(), lse_ptr, stream, _interop.TORCH, device)
    return (out, lse) if return_lse else out


def _cupy_attention(q: Any, k: Any, v: Any, device: int, options: tuple[Any, ...], return_lse: bool) -> Any:
    cupy = _interop.cupy_module()

    if _current_device() != device:  # allocate and launch on the inputs' device
        with cupy.cuda.Device(device):
            return _cupy_attention(q, k, v, device, options, return_lse)
    names = lambda: (q.dtype.name, k.dtype.name, v.dtype.name)  # noqa: E731
    plan = _plan_for((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), names, device, options)
    if plan.negate_q:
        q = -q
    inputs = [q, k, v]
    strides = []
    for i, x in enumerate(inputs):  # copies stay referenced in `inputs` until the launch
        elem_strides = _interop.element_strides(x)
        if not _interop.kernel_readable(x.data.ptr, x.shape, elem_strides):
            inputs[i] = x = _interop.readable_copy(_interop.CUPY, x)
            elem_strides = _interop.element_strides(x)
        strides.append(elem_strides)
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty(plan.lse_shape, dtype=cupy.float32) if return_lse else None
    if POISON_OUTPUTS:
        out.fill(math.nan)
        if lse is not None:
            lse.fill(math.nan)
    if plan.kernel is not None:
        ptrs = (inputs[0].data.ptr, inputs[1].data.ptr, inputs[2].data.ptr)
        lse_ptr = 0 if lse is None else lse.data.ptr
        stream = cupy.cuda.get_current_stream().ptr
        _launch(plan, ptrs, tuple(strides), out.data.ptr, lse_ptr, stream, _interop.CUPY, device)  # type: ignore[arg-type]
    return (out, lse) if return_lse else out


def _gpu_varlen(
    kind: str, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, problem: Problem, device: int, return_lse: bool,
    algorithm: str,
) -> tuple[Any, Any]:  # fmt: skip
    """A forward kernel on packed sequences: batch strides 0, each tile finds its rows in
    cu_seqlens (the Hopper kernel loads them through tensor maps over the packed tensors).

    Output rows outside every sequence (past cu_seqlens_q[-1]) are zero, their LSE -inf.
    """
    import cupy

    torch_like = kind == _interop.TORCH
    if torch_like:
        import torch

        def name(x: Any) -> str:
            return str(x.dtype).removeprefix("torch.")

        ptr = lambda x: x.data_ptr()  # noqa: E731
        strides = lambda x: tuple(x.stride())  # noqa: E731
    else:

        def name(x: Any) -> str:
            return str(x.dtype.name)

        ptr = lambda x: x.data.ptr  # noqa: E731
        strides = _interop.element_strides
    for label, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if name(cu) != "int32":
            raise TypeError(f"{label} must be int32 (as flash-attn's), got {name(cu)}")
    p = problem
    total_q, total_k = q.shape[0], k.shape[0]
    plan = _build_plan(
        p, (name(q), name(k), name(v)), device, algorithm=algorithm, axes=(-1, 0, 1),
        o_strides=(0, p.heads_q * p.head_dim, p.head_dim),
        lse_shape=(p.heads_q, total_q), lse_strides=(0, total_q), param_seqlens=(total_q, total_k),
    )  # fmt: skip
    with cupy.cuda.Device(device):
        if plan.negate_q:
            q = -q
        inputs = [q, k, v]
        for i, x in enumerate(inputs):  # copies stay referenced in `inputs` until the launch
            if not _interop.kernel_readable(ptr(x), x.shape, strides(x)):
                inputs[i] = _interop.readable_copy(kind, x)
        cus = [c if c.stride(0) == 1 else c.contiguous() for c in (cu_q, cu_k)] if torch_like else [
            cupy.ascontiguousarray(c) for c in (cu_q, cu_k)]  # fmt: skip
        fill = math.nan if POISON_OUTPUTS else 0.0  # rows outside every sequence stay 0 / -inf
        lse_fill = math.nan if POISON_OUTPUTS else -math.inf
        if torch_like:
            out = torch.full(q.shape, fill, dtype=q.dtype, device=q.device)
            lse = torch.full(plan.lse_shape, lse_fill, dtype=torch.float32, device=q.device)
            stream = _interop.torch_current_stream(device)
        else:
            out = cupy.full(q.shape, fill, dtype=q.dtype)
            lse = cupy.full(plan.lse_shape, lse_fill, dtype=cupy.float32)
            stream = cupy.cuda.get_current_stream().ptr
        if plan.kernel is not None:
            _launch(
                plan, tuple(ptr(x) for x in inputs), tuple(strides(x) for x in inputs),  # type: ignore[arg-type]
                ptr(out), ptr(lse) if return_lse else 0, stream, kind, device, cu_seqlens=(ptr(cus[0]), ptr(cus[1])),
            )  # fmt: skip
    return out, lse


def _baseline_attention(q: Any, k: Any, v: Any, options: tuple[Any, ...], return_lse: bool) -> Any:
    """``algorithm="fa1"`` / ``"naive"``: the host algorithms, or on the GPU the baselines of the
    IO study (cupyflash/_baselines_gpu.py)."""
    from . import _baselines_gpu

    causal, scale, window, softcap, layout, algorithm = options
    kind, device = _interop.common_placement(q=q, k=k, v=v)
    problem = attention_problem(
        q.shape, k.shape, v.shape, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout
    )
    if kind == _interop.HOST:
        return _host_attention(q, k, v, problem, algorithm, return_lse)
    if kind == _interop.DLPACK:
        import cupy
        from array_api_compat import array_namespace

        q_cp, k_cp, v_cp = (cupy.from_dlpack(x) for x in (q, k, v))
        out, lse = _baselines_gpu.gpu_attention(_interop.CUPY, q_cp, k_cp, v_cp, device, problem, algorithm)
        xp = array_namespace(q)
        return (xp.from_dlpack(out), xp.from_dlpack(lse)) if return_lse else xp.from_dlpack(out)
    out, lse = _baselines_gpu.gpu_attention(kind, q, k, v, device, problem, algorithm)
    return (out, lse) if return_lse else out


def _dlpack_attention(q: Any, k: Any, v: Any, options: tuple[Any, ...], return_lse: bool) -> Any:
    """Any other GPU array: zero-copy into CuPy, run, hand the results back through DLPack."""
    import cupy
    from array_api_compat import array_namespace

    q_cp, k_cp, v_cp = (cupy.from_dlpack(x) for x in (q, k, v))
    out, lse = _cupy_attention(q_cp, k_cp, v_cp, q_cp.device.id, options, return_lse=True)
    xp = array_namespace(q)
    return (xp.from_dlpack(out), xp.from_dlpack(lse)) if return_lse else xp.from_dlpack(out)


_current_device = _interop.current_device
