"""Float8 KV caches for ``attention_with_kvcache``: the two formats, the scales and their checks,
and the host twin of the kernels' dequantisation and quantisation on append.

A cached float8 value ``c`` of KV head ``h`` stands for ``c * scale[h]`` (float32 scales: one per
tensor, shape ``()`` or ``(1,)``, or one per KV head, ``(Hkv,)``). Appended tokens are stored as
``saturate(round_to_nearest_even(float32(x) / scale))`` -- the rule of vLLM's and FlashInfer's
cache writes (CUDA's ``__nv_cvt_float_to_fp8`` with ``__NV_SATFINITE``): the quotient rounded once
in float32, then to the nearest float8 value, ties to even; beyond the largest finite value
(448 for e4m3, 57344 for e5m2) it saturates there, infinities included; NaN stays NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: kv_dtype spellings -> the format; the dtype names torch and ml_dtypes give the formats.
FORMATS = {"e4m3": "e4m3", "e5m2": "e5m2", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
DTYPE_NAMES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
#: The largest finite value of each format: where quantisation saturates.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


@dataclass(frozen=True, slots=True)
class Fp8Cache:
    """A float8 cache as a plan sees it: the format, and each scale's form: "host" (a float given
    per call; the default 1.0 when none is given), "tensor" (a device array of one value) or
    "head" (a device array of one value per KV head)."""

    format: str
    k_scale: str = "host"
    v_scale: str = "host"


def cache_format(k_dtype: str, v_dtype: str, kv_dtype: Any) -> str | None:
    """The caches' float8 format from their dtype names (``float8_e4m3fn`` / ``float8_e5m2``, or
    ``uint8`` bytes named by ``kv_dtype``), or None for caches of q's type (kv_dtype not given)."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in FORMATS):
        raise ValueError(f"kv_dtype must be one of 'e4m3', 'e5m2' (or None), got {kv_dtype!r}")
    named = None if kv_dtype is None else FORMATS[kv_dtype]
    if k_dtype != v_dtype:
        if named is not None or "float8" in k_dtype + v_dtype or "uint8" in (k_dtype, v_dtype):
            raise TypeError(f"k_cache and v_cache must have one dtype, got {k_dtype} and {v_dtype}")
        return None  # (16-bit caches of two dtypes: the dtype checks say so)
    if k_dtype in ("float8_e4m3fn", "float8_e5m2"):
        fmt = FORMATS[k_dtype]
        if named is not None and named != fmt:
            raise ValueError(f"kv_dtype={kv_dtype!r} does not match the caches' dtype {k_dtype}")
        return fmt
    if k_dtype in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float8_e4m3b11fnuz"):
        raise TypeError(
            f"the cache's dtype {k_dtype} is not a supported float8 format: use float8_e4m3fn or float8_e5m2"
        )
    if k_dtype == "uint8":
        if named is None:
            raise TypeError(
                "a uint8 cache holds float8 bytes: name their format with kv_dtype='e4m3' (float8_e4m3fn) or 'e5m2'"
            )
        return named
    if named is not None:
        raise TypeError(
            f"kv_dtype={kv_dtype!r} is for a float8 cache (torch.float8_e4m3fn / float8_e5m2 tensors, ml_dtypes' "
            f"float8 arrays, or uint8 bytes), but the caches are {k_dtype}"
        )
    return None


def is_host_number(x: Any) -> bool:
    """Whether a scale is given as a host number (anything but an array: a Python or NumPy real,
    a NumPy 0-d array, or something ``host_scale`` refuses), not as an array (an operand)."""
    shape = getattr(x, "shape", None)
    return shape is None or (shape == () and type(x).__module__.split(".")[0] == "numpy")


def host_scale(name: str, x: Any) -> float | None:
    """A scale given as a host number (a Python or NumPy real): its float32 value, checked
    positive and finite; None for an array (or None: the default, 1.0, is the caller's)."""
    if x is None or isinstance(x, bool):
        if isinstance(x, bool):
            raise TypeError(f"{name} must be a positive float or a float32 array, got {x!r}")
        return None
    if not is_host_number(x):
        return None
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive float or a float32 array, got {type(x).__name__}") from None
    value32 = float(_float32(value))
    if not (math.isfinite(value32) and value32 > 0):
        raise ValueError(f"{name} must be positive and finite in float32, got {value!r}")
    return value32


def _float32(value: float) -> Any:
    import numpy as np

    with np.errstate(over="ignore"):
        return np.float32(value)


def scale_form(name: str, shape: tuple[int, ...], dtype: str, heads_kv: int) -> str:
    """ "tensor" or "head" for a scale array of ``shape`` and ``dtype``, else the error."""
    if dtype != "float32":
        raise TypeError(f"{name} must be float32, got {dtype}")
    if shape in ((), (1,)):
        return "tensor"
    if shape == (heads_kv,):
        return "head"
    raise ValueError(f"{name} must have shape () or (1,) (one scale) or (heads_kv,) = ({heads_kv},), got {shape}")


def refuse_scales_without_fp8(k_scale: Any, v_scale: Any, dtype: str) -> None:
    if k_scale is not None or v_scale is not None:
        raise TypeError(
            f"k_scale / v_scale dequantise a float8 cache, but the caches are {dtype} (float8 caches are "
            "torch.float8_e4m3fn / float8_e5m2 tensors, ml_dtypes' float8 arrays, or uint8 bytes with kv_dtype)"
        )


# ---------------------------------------------------------------------------------------------
# The host twin (NumPy with ml_dtypes' float8 arrays or uint8 bytes; PyTorch CPU float8 tensors
# or uint8 bytes): dequantise in the compute dtype, quantise by the rule above.
# ---------------------------------------------------------------------------------------------
def dtype_name(x: Any) -> str:
    """An array's dtype by name, whatever its library ("float8_e4m3fn", "uint8", "bfloat16": a
    PyTorch dtype without "torch."); a non-array's type name, for the messages that refuse it."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    return str(getattr(dtype, "name", dtype)).removeprefix("torch.")


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _check_host_cache(name: str, x: Any) -> None:
    module = type(x).__module__.split(".")[0]
    if module not in ("numpy", "torch"):
        raise TypeError(
            f"a float8 {name} on the host must be a NumPy array (ml_dtypes float8, or uint8) or a PyTorch CPU "
            f"tensor, got {type(x).__module__}.{type(x).__name__}"
        )


def float8_view(x: Any, fmt: str) -> Any:
    """The cache as float8 values (a view of uint8 bytes)."""
    if is_torch(x):
        import torch

        dtype = getattr(torch, DTYPE_NAMES[fmt])
        return x if x.dtype == dtype else x.view(dtype)
    import ml_dtypes

    dtype = getattr(ml_dtypes, DTYPE_NAMES[fmt])
    return x if x.dtype == dtype else x.view(dtype)


def host_scale_array(xp: Any, name: str, scale: Any, heads_kv: int, like: Any) -> Any:
    """A host scale (None: 1.0; a number; a float32 array of (), (1,) or (Hkv,) in the caches'
    namespace, every value checked positive and finite) as a float64 (Hkv, 1) array of like's
    namespace: it multiplies a [.., Hkv, d] cache."""
    from .reference import to_numpy64

    value = 1.0 if scale is None else host_scale(name, scale)
    if value is None:
        dtype = dtype_name(scale)
        scale_form(name, tuple(scale.shape), dtype, heads_kv)
        values = to_numpy64(scale).reshape(-1)
        bad = [float(v) for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"{name} must be positive and finite, got {bad}")
    else:
        import numpy as np

        values = np.array([value])
    import numpy as np

    column = np.broadcast_to(values, (heads_kv,)).reshape(heads_kv, 1).copy()
    if is_torch(like):
        import torch

        return torch.from_numpy(column)
    return xp.asarray(column)


def dequantise(xp: Any, name: str, cache: Any, fmt: str, scale: Any, compute: Any) -> Any:
    """The cache's values ``float8 * scale`` in the ``compute`` dtype (float32, or float64 for
    float64 queries): [.., Hkv, d] times the (Hkv, 1) scale column."""
    _check_host_cache(name, cache)
    values = float8_view(cache, fmt)
    if is_torch(values):
        import torch

        dtype = torch.float64 if compute == xp.float64 else torch.float32
        return values.to(dtype) * scale.to(dtype)
    return values.astype(compute) * xp.astype(scale, compute)


def quantise(xp: Any, new: Any, fmt: str, scale: Any, like: Any) -> Any:
    """``new`` [B, N, Hkv, d] as the cache ``like`` stores it (its float8 dtype, or uint8 bytes):
    float32(new) / float32(scale), rounded to the nearest float8 value (ties to even), saturated
    to +-FP8_MAX[fmt] (infinities too); NaN stays NaN."""
    limit = FP8_MAX[fmt]
    if is_torch(like):
        import torch

        quotient = new.to(torch.float32) / scale.to(torch.float32)
        # clamp keeps NaN; torch's cast of e4m3 saturates past 448 too, not e5m2's (inf): the clamp
        # makes both the rule above.
        q = torch.clamp(quotient, -limit, limit).to(getattr(torch, DTYPE_NAMES[fmt]))
        return q if like.dtype == q.dtype else q.view(torch.uint8)
    import ml_dtypes
    import numpy as np

    quotient = np.asarray(new, dtype=np.float32) / np.asarray(scale, dtype=np.float32)
    # ml_dtypes rounds to nearest even and overflows to NaN (e4m3) or inf (e5m2): clamp first.
    values = np.clip(quotient, -limit, limit).astype(getattr(ml_dtypes, DTYPE_NAMES[fmt]))
    return values if like.dtype == values.dtype else values.view(np.uint8)


# ---------------------------------------------------------------------------------------------
# The public quantiser: a float8 cache (or any float8 operand) and its scale from 16/32-bit data.
# ---------------------------------------------------------------------------------------------
_HEAD_AXIS = {"bshd": 2, "bhsd": 1}


def quantize_fp8(x: Any, *, fmt: str = "e4m3", per: str = "head", layout: str = "bshd") -> tuple[Any, Any]:
    """Quantise ``x`` to float8 with the scale a float8 KV cache reads it by.

    Parameters
    ----------
    x : PyTorch tensor (any device) or NumPy array, float16 / bfloat16 / float32 / float64, 4-d:
        ``(B, N, H, d)`` for ``layout="bshd"`` (also a paged cache ``(pages, page_size, Hkv, d)``)
        or ``(B, H, N, d)`` for ``"bhsd"``.
    fmt : {"e4m3", "e5m2"}
    per : {"head", "tensor"}
        One scale per head (the cache's ``(Hkv,)`` form) or one for the whole tensor (``()``).
    layout : {"bshd", "bhsd"}
        Where the head axis is.

    Returns
    -------
    (values, scale) : ``values`` as ``x``'s library stores float8 (``torch.float8_e4m3fn`` /
        ``float8_e5m2``, or ml_dtypes' float8 for NumPy) and ``scale`` float32 of shape ``(H,)``
        or ``()`` on ``x``'s device, such that ``values * scale`` approximates ``x``: the largest
        finite ``|x|`` of each head (or of the tensor) maps to the format's largest value (448 for
        e4m3, 57344 for e5m2), each value is rounded once to the nearest float8 value, ties to
        even, as ``attention_with_kvcache`` stores appended tokens. NaN stays NaN; +-inf
        saturates; a head of zeros gets scale 1. Pass them as ``k_cache`` / ``k_scale`` (and
        ``v_cache`` / ``v_scale``) to ``attention_with_kvcache``.
    """
    if fmt not in FP8_MAX:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if per not in ("head", "tensor"):
        raise ValueError(f"per must be 'head' or 'tensor', got {per!r}")
    module = _check_quantizable("quantize_fp8", x, layout)
    head_axis = _HEAD_AXIS[layout]
    reduce_axes = tuple(a for a in range(4) if a != head_axis or per == "tensor")
    limit = FP8_MAX[fmt]
    x32: Any  # a torch tensor or a NumPy array, as x
    scale: Any
    like: Any
    if module == "torch":
        import torch

        x32 = x.to(torch.float32)
        magnitude = torch.where(torch.isfinite(x32), x32.abs(), torch.zeros((), dtype=torch.float32, device=x.device))
        amax = torch.amax(magnitude, dim=reduce_axes)
        scale = torch.where(amax > 0, amax / limit, torch.ones((), dtype=torch.float32, device=x.device))
        like = torch.empty(0, dtype=getattr(torch, DTYPE_NAMES[fmt]))
    else:
        import ml_dtypes
        import numpy as np

        x32 = np.asarray(x, dtype=np.float32)
        with np.errstate(invalid="ignore"):
            amax = np.max(np.where(np.isfinite(x32), np.abs(x32), 0.0), axis=reduce_axes).astype(np.float32)
        scale = np.where(amax > 0, amax / np.float32(limit), np.float32(1.0)).astype(np.float32)
        like = np.empty(0, dtype=getattr(ml_dtypes, DTYPE_NAMES[fmt]))
    shape = [1, 1, 1, 1]
    if per == "head":
        shape[head_axis] = x.shape[head_axis]
    values = quantise(None, x32, fmt, scale.reshape(shape), like)
    return values, scale


def _check_quantizable(caller: str, x: Any, layout: str) -> str:
    """x's library ("torch" or "numpy"), after the checks of a 4-d float array in ``layout``."""
    if layout not in _HEAD_AXIS:
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    module = type(x).__module__.split(".")[0]
    if module not in ("torch", "numpy"):
        raise TypeError(
            f"{caller} takes a PyTorch tensor or a NumPy array (the libraries with a float8 dtype), "
            f"got {type(x).__module__}.{type(x).__name__}"
        )
    dtype = dtype_name(x)
    if dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"{caller} takes float16, bfloat16, float32 or float64 data, got {dtype}")
    if x.ndim != 4:
        raise ValueError(f"{caller} takes a 4-d array ({layout}), got shape {tuple(x.shape)}")
    return module


def quantize_qk_fp8(q: Any, k: Any, *, hadamard: bool = False, layout: str = "bshd") -> tuple[Any, Any, Any, Any]:
    """q and k for the FP8 forward (``attention`` with e4m3 inputs): ``(q8, q_descale, k8, k_descale)``.

    q is quantised per tensor (the kernel's q_descale is per KV head, shared by a group's query
    heads), k per head, as :func:`quantize_fp8` does (e4m3). V is quantised on its own
    (``quantize_fp8(v)``): the rotation below is not for V.

    hadamard : bool
        Rotate q and k first by the same orthonormal Hadamard matrix H / sqrt(d) over head_dim
        (a power of two): ``(q H)(k H)^T = q k^T``, so the attention is unchanged, while a large
        entry (an outlier channel) is spread over all d channels before the cast, which lowers
        the quantisation error (FlashAttention-3's incoherent processing; docs/fp8_forward.md:
        1.7-4.4x lower RMSE on outlier inputs, no change on Gaussian ones). Both are rotated
        here, together, because rotating one alone gives a plausible wrong answer. NaN in a row
        makes the whole rotated row NaN (the same row's output is NaN either way); the rotation
        runs in float32 (float64 for NumPy) on x's device.
    """
    if hadamard:
        q, k = (_hadamard_rotated(name, x, layout) for name, x in (("q", q), ("k", k)))
    q8, q_scale = quantize_fp8(q, per="tensor", layout=layout)
    k8, k_scale = quantize_fp8(k, per="head", layout=layout)
    return q8, q_scale, k8, k_scale


def _hadamard_rotated(name: str, x: Any, layout: str) -> Any:
    """x @ H / sqrt(d) over the last axis, H the Sylvester Hadamard matrix of order d."""
    import numpy as np

    module = _check_quantizable("quantize_qk_fp8", x, layout)
    d = int(x.shape[-1])
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of two, {name} has {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(d)
    if module == "torch":
        import torch

        return x.to(torch.float32) @ torch.from_numpy(h).to(device=x.device, dtype=torch.float32)
    return np.asarray(x, dtype=np.float64) @ h
