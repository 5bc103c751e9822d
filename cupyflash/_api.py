"""The public functions. ``attention`` validates, picks the path for the caller's arrays (CuPy,
PyTorch, other DLPack GPU arrays, or host arrays of any array-API namespace), and on the GPU
packs one ``AttnParams`` and launches one kernel on the caller's stream."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, overload

from . import _interop, _kernels
from ._dispatch import MaskFlags, fa2_fwd_grid, fa2_fwd_spec
from ._params import pack_attn_params
from ._specs import CUDA_ELEMENT_TYPES, FA2_HEAD_DIMS
from ._validate import Problem, attention_problem, check_algorithm

GPU_ALGORITHMS = ("auto", "fa2")

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
    q: Any, k: Any, v: Any, *, causal: bool = ..., scale: float | None = ..., window: tuple[int, int] = ...,
    softcap: float = ..., layout: str = ..., algorithm: str = ..., return_lse: Literal[False] = ...,
) -> Any: ...
@overload
def attention(
    q: Any, k: Any, v: Any, *, causal: bool = ..., scale: float | None = ..., window: tuple[int, int] = ...,
    softcap: float = ..., layout: str = ..., algorithm: str = ..., return_lse: Literal[True],
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
    algorithm : {"auto", "fa2", "fa1", "naive", "decode"}
        On the GPU: ``"auto"``/``"fa2"`` (float16/bfloat16, head_dim 32, 64, 96, 128, 192, 256).
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
    algorithm = check_algorithm(algorithm)
    kind, device = _interop.common_placement(q=q, k=k, v=v)
    problem = attention_problem(
        q.shape, k.shape, v.shape, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout
    )
    if kind == _interop.HOST:
        return _host_attention(q, k, v, problem, algorithm, return_lse)
    if algorithm not in GPU_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} has no GPU kernel yet; on the GPU use one of {GPU_ALGORITHMS}")
    if kind == _interop.TORCH:
        return _torch_attention(q, k, v, problem, device, return_lse)
    if kind == _interop.CUPY:
        return _cupy_attention(q, k, v, problem, device, return_lse)
    return _dlpack_attention(q, k, v, problem, return_lse)


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
    out, lse = xp_impl.attention(xp, q, k, v, problem, algorithm="fa2" if algorithm == "auto" else algorithm)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# GPU: one launch plan per (variant, device), cached; one params pack per call.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Fa2Launch:
    kernel: _kernels.CompiledKernel
    block_m: int
    threads: tuple[int, int, int]
    smem: int


_launches: dict[tuple[str, int, bool, bool, bool, int], _Fa2Launch] = {}
_max_smem: dict[int, int] = {}


def _device_max_smem(device: int) -> int:
    smem = _max_smem.get(device)
    if smem is None:
        import cupy

        smem = _max_smem[device] = cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]
    return smem


def _check_gpu_dtypes(q_dtype: str, k_dtype: str, v_dtype: str, head_dim: int) -> None:
    if not (q_dtype == k_dtype == v_dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q_dtype}, {k_dtype}, {v_dtype}")
    if q_dtype not in CUDA_ELEMENT_TYPES:
        raise TypeError(f"the GPU kernels take {sorted(CUDA_ELEMENT_TYPES)}, got {q_dtype}")
    if head_dim not in FA2_HEAD_DIMS:
        raise ValueError(f"the GPU kernels support head_dim in {FA2_HEAD_DIMS}, got {head_dim}")


def _fa2_launch(dtype: str, problem: Problem, device: int) -> _Fa2Launch:
    key = (dtype, problem.head_dim, problem.causal_bound, problem.local_bound, problem.softcap > 0, device)
    launch = _launches.get(key)
    if launch is None:
        flags = MaskFlags(problem.causal_bound, problem.local_bound, problem.softcap > 0)
        spec = fa2_fwd_spec(dtype, problem.head_dim, flags, _device_max_smem(device))
        kernel = _kernels.get_kernel(spec, device)
        launch = _launches[key] = _Fa2Launch(kernel, spec.tile.block_m, (spec.num_threads, 1, 1), spec.smem_bytes)
    return launch


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


def _row_strides(view: _interop.GpuView, layout: str) -> tuple[int, int, int]:
    """(batch, row, head) strides of a 4-D view."""
    s = view.strides
    return (s[0], s[1], s[2]) if layout == "bshd" else (s[0], s[2], s[1])


def _launch_fa2(
    launch: _Fa2Launch,
    problem: Problem,
    q: _interop.GpuView,
    k: _interop.GpuView,
    v: _interop.GpuView,
    o: _interop.GpuView,
    lse_ptr: int,
    stream: Any,
) -> None:
    p = problem
    scale_log2, softcap_prescale, _ = _softmax_factors(p)
    params = pack_attn_params(
        q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr,
        *_row_strides(q, p.layout), *_row_strides(k, p.layout), *_row_strides(v, p.layout),
        *_row_strides(o, p.layout),
        p.heads_q * p.seqlen_q, p.seqlen_q,
        p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.heads_q // p.heads_kv,
        p.window_left, p.window_right, scale_log2, softcap_prescale,
    )  # fmt: skip
    grid = (-(-p.seqlen_q // launch.block_m), p.batch, p.heads_q)
    launch.kernel.function(grid, launch.threads, (params,), shared_mem=launch.smem, stream=stream)


def _gpu_shape_check(problem: Problem) -> bool:
    """False when there is nothing to compute (an empty output)."""
    if problem.batch > 65535 or problem.heads_q > 65535:
        raise ValueError(f"batch ({problem.batch}) and heads ({problem.heads_q}) must be <= 65535 on the GPU")
    return problem.batch > 0 and problem.seqlen_q > 0 and problem.heads_q > 0


def _torch_attention(q: Any, k: Any, v: Any, problem: Problem, device: int, return_lse: bool) -> Any:
    import torch

    views = [_interop.torch_view(x) for x in (q, k, v)]
    _check_gpu_dtypes(views[0].dtype, views[1].dtype, views[2].dtype, problem.head_dim)
    *_, negate_q = _softmax_factors(problem)
    if negate_q:
        q = -q
        views[0] = _interop.torch_view(q)
    for i, (x, view) in enumerate(zip((q, k, v), views)):
        if not _interop.kernel_readable(view):
            views[i] = _interop.torch_view(_interop.readable_copy(_interop.TORCH, x))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((problem.batch, problem.heads_q, problem.seqlen_q), dtype=torch.float32, device=q.device)
    if POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    if _gpu_shape_check(problem):
        launch = _fa2_launch(views[0].dtype, problem, device)
        stream = _interop.torch_current_stream(device)
        with _on_device(device):
            _launch_fa2(launch, problem, *views, _interop.torch_view(out), lse.data_ptr() if return_lse else 0, stream)
    return (out, lse) if return_lse else out


def _cupy_attention(q: Any, k: Any, v: Any, problem: Problem, device: int, return_lse: bool) -> Any:
    import cupy

    views = [_interop.cupy_view(x) for x in (q, k, v)]
    _check_gpu_dtypes(views[0].dtype, views[1].dtype, views[2].dtype, problem.head_dim)
    with _on_device(device):
        *_, negate_q = _softmax_factors(problem)
        if negate_q:
            q = -q
            views[0] = _interop.cupy_view(q)
        for i, (x, view) in enumerate(zip((q, k, v), views)):
            if not _interop.kernel_readable(view):
                views[i] = _interop.cupy_view(_interop.readable_copy(_interop.CUPY, x))
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((problem.batch, problem.heads_q, problem.seqlen_q), dtype=cupy.float32)
        if POISON_OUTPUTS:
            out.fill(math.nan)
            lse.fill(math.nan)
        if _gpu_shape_check(problem):
            launch = _fa2_launch(views[0].dtype, problem, device)
            stream = cupy.cuda.get_current_stream()
            _launch_fa2(launch, problem, *views, _interop.cupy_view(out), lse.data.ptr if return_lse else 0, stream)
    return (out, lse) if return_lse else out


def _dlpack_attention(q: Any, k: Any, v: Any, problem: Problem, return_lse: bool) -> Any:
    """Any other GPU array: zero-copy into CuPy, run, hand the results back through DLPack."""
    import cupy
    from array_api_compat import array_namespace

    q_cp, k_cp, v_cp = (cupy.from_dlpack(x) for x in (q, k, v))
    out, lse = _cupy_attention(q_cp, k_cp, v_cp, problem, q_cp.device.id, return_lse=True)
    xp = array_namespace(q)
    return (xp.from_dlpack(out), xp.from_dlpack(lse)) if return_lse else xp.from_dlpack(out)


class _on_device:
    """Make ``device`` current for CuPy only when it is not already (the check costs ~0.1 us)."""

    __slots__ = ("device", "previous")

    def __init__(self, device: int) -> None:
        self.device = device
        self.previous = -1

    def __enter__(self) -> None:
        import cupy

        current = cupy.cuda.runtime.getDevice()
        if current != self.device:
            self.previous = current
            cupy.cuda.runtime.setDevice(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.previous >= 0:
            import cupy

            cupy.cuda.runtime.setDevice(self.previous)
