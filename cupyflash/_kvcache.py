"""Decoding over a KV cache: ``attention_with_kvcache`` (FlashDecoding, as flash-attn's
``flash_attn_with_kvcache``) and ``merge_states`` (the exact merge of two attention states).

Each is validate -> plan -> run, as ``attention``. On the GPU a decode call is at most two
launches on the caller's stream -- append k_new / v_new into the cache, then the split-KV kernel
(whose last split of each row merges the partials: no combine launch); the splits' tickets and
partials live in a per-stream buffer (``_workspace``). Device arrays are never read back on the
host; host arrays run ``xp_impl`` in their own namespace, every value checked first.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Literal, overload

from . import _device, _fp8, _host, _interop, _launch, _plan
from ._validate import (
    check_alibi,
    check_num_splits,
    check_options,
    check_scale_option,
    kvcache_problem,
    merge_problem,
)

_plans = _plan.new_cache()
_merge_plans = _plan.new_cache()
_KV_NAMES = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new", "cache_batch_idx",
             "cache_leftpad", "alibi_slopes", "rotary_cos", "rotary_sin", "k_scale", "v_scale")  # fmt: skip
_kv_operands = operator.itemgetter(*_KV_NAMES)


@overload
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = ...,
    k_new: Any = ...,
    v_new: Any = ...,
    cache_batch_idx: Any = ...,
    cache_leftpad: Any = ...,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Any = ...,
    rotary_cos: Any = ...,
    rotary_sin: Any = ...,
    rotary_interleaved: bool = ...,
    num_splits: int = ...,
    return_lse: Literal[False] = ...,
    k_scale: Any = ...,
    v_scale: Any = ...,
    kv_dtype: str | None = ...,
) -> Any: ...
@overload
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = ...,
    k_new: Any = ...,
    v_new: Any = ...,
    cache_batch_idx: Any = ...,
    cache_leftpad: Any = ...,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Any = ...,
    rotary_cos: Any = ...,
    rotary_sin: Any = ...,
    rotary_interleaved: bool = ...,
    num_splits: int = ...,
    return_lse: Literal[True],
    k_scale: Any = ...,
    v_scale: Any = ...,
    kv_dtype: str | None = ...,
) -> tuple[Any, Any]: ...
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = None,
    k_new: Any = None,
    v_new: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    rotary_interleaved: bool = True,
    num_splits: int = 0,
    return_lse: bool = False,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: str | None = None,
) -> Any:
    """Attention of a few new query tokens over a KV cache, as flash-attn's
    ``flash_attn_with_kvcache`` (FlashDecoding: the keys are split over many CTAs and the
    partial results merged exactly).

    Parameters
    ----------
    q : array ``(B, Nq, Hq, d)``; on the GPU float16 or bfloat16, d from 1 to 256. Up to 16 query
        tokens run on the split-KV decode kernel; more (chunked prefill against a cache) on the
        FA2 kernel, which reads the cache in place as the decode kernel does
    k_cache, v_cache : arrays, contiguous ``(B, L_max, Hkv, d)`` (``(entries, L_max, Hkv, d)``
        with ``cache_batch_idx``), or paged
        ``(num_pages, page_size, Hkv, d)`` with ``block_table``; ``page_size`` any power of two
        (1, 2, ..., 16, ..., 256 ...). Same library, device and dtype as ``q``; ``Hq % Hkv == 0``.
        Modified in place when ``k_new`` / ``v_new`` are given (JAX arrays are not: see Returns).
    cache_seqlens : int or int32 array ``(B,)``
        Tokens already in each sequence's cache.
    block_table : int32 array ``(B, max_pages)``, optional
        Page of each ``page_size`` keys of each sequence: key ``j`` of sequence ``b`` is slot
        ``j % page_size`` of page ``block_table[b, j // page_size]``.
    k_new, v_new : arrays ``(B, Nnew, Hkv, d)``, optional
        Written into the cache at positions ``cache_seqlens[b] ..`` before attending; the
        attention then covers ``Nk_b = cache_seqlens[b] + Nnew`` keys.
    cache_batch_idx : int32 array ``(B,)``, optional (contiguous caches)
        The cache entry of each sequence: sequence ``b`` reads and appends to
        ``k_cache[cache_batch_idx[b]]`` (flash-attn's argument; the cache may then have any number
        of entries). An entry named twice is read by both sequences; with ``k_new`` it is refused
        (flash-attn leaves it undefined: the entry would end up with tokens of either sequence):
        on host arrays before anything runs, on the GPU by the kernels, which append nothing for
        both sequences, give them NaN rows and report it to :func:`check_device_errors`.
    cache_leftpad : int32 array ``(B,)``, optional (contiguous caches)
        The first key of each sequence's entry (a left-padded cache): sequence ``b`` attends to
        keys ``cache_leftpad[b] .. cache_seqlens[b] + Nnew - 1``, and ``Nk_b`` counts from there;
        the append still goes to ``cache_seqlens[b] ..``.
    causal : bool
        Bottom-right aligned within each sequence: query ``i`` sees key ``j`` iff
        ``j <= i + Nk_b - Nq``. For Nq = 2 over Nk_b = 5 keys (1 = visible)::

            1 1 1 1 0
            1 1 1 1 1

        With one query token it changes nothing.
    scale : float, optional
        Defaults to ``1 / sqrt(d)``.
    window : (int, int)
        Sliding window ``(left, right)`` as ``attention``'s, aligned as ``causal`` (a bound of -1
        is none; with ``causal`` the right bound is 0): query ``i`` sees keys
        ``i + Nk_b - Nq - left .. i + Nk_b - Nq + right``. The kernels skip the key blocks
        before the window.
    softcap : float
        Scores pass through ``softcap * tanh(score / softcap)`` (Gemma 2's cap), as ``attention``'s.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi, as ``attention``'s: the score of query ``i`` and key ``j`` gains
        ``-slope * |i + Nk_b - Nq - j|``. On the GPU it runs on the FA2 kernel (after the softcap, if any).
    rotary_cos, rotary_sin : arrays ``(seqlen_ro, rotary_dim / 2)``, optional, q's dtype
        Rotary embedding applied before attending, as flash-attn's: ``k_new`` token ``t`` of
        sequence ``b`` is rotated at position ``cache_seqlens[b] + t`` as it is appended, query
        token ``i`` at ``cache_seqlens[b] + i`` when ``causal`` or a ``window`` is set, else all at
        ``cache_seqlens[b]``; the first ``rotary_dim`` columns rotate, the rest pass. Needs
        ``k_new``; a row for every position a key or query can take (the capacity, and
        ``capacity - Nnew + Nq`` when causal queries outnumber the new tokens). On the GPU the append rotates
        k_new and a small kernel rotates q into a temporary (one launch more).
    rotary_interleaved : bool
        flash-attn's: pairs columns ``(2i, 2i + 1)`` (True, its default) or ``(i, i + rotary_dim / 2)``
        (False, GPT-NeoX's and Llama's).
    num_splits : int
        Splits of the KV sequence: 0 chooses from the GPU's SM count, the batch, the heads and
        the cache length; 1 runs the same kernel without splitting (no combine step).
    return_lse : bool
        Also return the float32 natural-log LSE ``(B, Hq, Nq)``.
    k_scale, v_scale : float or float32 array ``()``, ``(1,)`` or ``(Hkv,)``, optional
        A float8 cache's scales (default 1.0): a cached value of KV head ``h`` reads as
        ``fp8 * scale[h]``. A host number is checked (positive, finite in float32); a device array
        is read as given, at run time (a captured graph sees its later values); a device k_scale
        that is negative, NaN or infinite gives NaN rows (without softcap, where the kernel folds it
        into the softmax's multiplier).
    kv_dtype : "e4m3" or "e5m2", optional
        The float8 format of ``uint8`` caches (CuPy has no float8 dtype: pass the bytes with this);
        ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensors and ml_dtypes' float8 NumPy arrays
        carry their own (``kv_dtype`` must then agree).

    Float8 caches: q, ``k_new`` and ``v_new`` stay in q's dtype and the output is q's. ``k_new`` /
    ``v_new`` are stored as ``saturate(round_to_nearest_even(float32(x) / scale))`` -- vLLM's and
    FlashInfer's rule (CUDA's ``__nv_cvt_float_to_fp8`` with ``__NV_SATFINITE``): beyond 448
    (e4m3) or 57344 (e5m2) a value saturates, infinities too; NaN stays NaN (torch's own cast
    overflows e5m2 to inf: clamp before it to get the same bytes). The GPU kernel widens the bytes
    exactly and applies the scales in float32 (the K scale in the softmax multiplier, the V scale
    in the output); it takes 1 to 16 query tokens, no ALiBi, head_dim 64 or 128, and refuses the
    rest by name. The host path dequantises (``float8 * scale`` in float32, float64 for float64 q)
    and runs the same algorithm; it takes NumPy and PyTorch CPU caches. Not under
    ``torch.compile`` with ``k_scale`` / ``v_scale`` / ``kv_dtype`` given.

    Returns
    -------
    out : array like ``q``; lse : ``(B, Hq, Nq)`` when ``return_lse``, float32 (float64 for float64
        host inputs)
    (result, k_cache, v_cache) : with JAX arrays and ``k_new``: ``result`` is ``out`` (or
        ``(out, lse)``) as above, and ``k_cache``, ``v_cache`` are new arrays, the caches with
        ``k_new`` / ``v_new`` appended (JAX arrays are immutable: the caches passed in are
        unchanged). Under ``jax.jit`` with the caches donated (``donate_argnums``) XLA appends in
        place, with no copy of the cache; otherwise the call copies each cache once.

    Notes
    -----
    On the GPU, an int ``cache_seqlens`` is checked against the cache on the host; values of
    device arrays are not read back (that would synchronise the device every step). The
    kernels check them instead: a sequence whose length is outside ``[0, capacity - Nnew]``, whose
    first key (``cache_leftpad``) is outside ``[0, cache_seqlens[b]]``, whose cache entry is outside
    the cache or whose pages in use include an id outside ``[0, num_pages)`` gets NaN output rows (and NaN
    LSE), and its ``k_new``/``v_new`` are not written anywhere, so no other sequence's cache is
    ever touched; :func:`check_device_errors` then raises :class:`DeviceValueError` naming what
    was wrong (it synchronises, so the decode step itself never does). Host
    arrays are checked in full before anything is written. The GPU path makes no
    synchronisation and no allocation outside the caller's library, so a decode step can be
    captured in a CUDA graph (warm it up once first: the first call compiles its kernels).

    JAX: inside ``jax.jit`` or ``vmap`` (and for concrete JAX arrays with ``k_new``) the call is one
    XLA custom call. On a GPU the kernels run on XLA's buffers and stream (device values checked
    by the kernels, as above: :func:`check_device_errors` after the jitted call); on JAX's CPU
    backend the host path runs (values checked there: a bad one fails the run with its message;
    bfloat16 computed as float32). Shapes, options and an int ``cache_seqlens`` are checked at
    trace time, the GPU's dtypes at the first run. There is no derivative (as flash-attn's, it is
    inference only): differentiating through it raises, naming the argument.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    >>> v_cache = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    >>> q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    >>> k_new = v_new = np.ones((2, 1, 1, 8), dtype=np.float32)
    >>> seqlens = np.array([3, 9], dtype=np.int32)
    >>> out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new)
    >>> out.shape, float(k_cache[1, 9, 0, 0])
    ((2, 1, 4, 8), 1.0)
    """
    if _interop.compiling():  # Dynamo traces the custom op, not this function's body
        if k_scale is not None or v_scale is not None or kv_dtype is not None:
            raise NotImplementedError(
                "attention_with_kvcache's k_scale / v_scale / kv_dtype do not go through torch.compile yet: call it "
                "outside the compiled region (a float8 cache with the default scales, 1.0, does)"
            )
        return _interop.torch_ops.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale, num_splits, return_lse,
            cache_batch_idx, cache_leftpad, window, softcap, alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved,
        )  # fmt: skip
    if type(causal) is not bool or window != (-1, -1) or softcap != 0.0:  # the defaults skip the checks
        causal, scale, window, softcap = check_options(causal, scale, window, softcap)
    elif scale is not None and type(scale) is not float:
        scale = check_scale_option(scale)
    if type(num_splits) is not int:
        num_splits = check_num_splits(num_splits)
    seqlens = None if type(cache_seqlens) is int else cache_seqlens
    batch_idx, leftpad, slopes, cos, sin = cache_batch_idx, cache_leftpad, alibi_slopes, rotary_cos, rotary_sin
    if slopes is not None:
        _interop.refuse_slope_grad(slopes)
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: give both or neither")
    rotary = None if cos is None else rotary_interleaved
    # Float8 caches' scales: a host number is checked here and goes to the kernel per call; an
    # array is an operand like the others (on the GPU read as given).
    k_host = v_host = None
    fp8_options = k_scale is not None or v_scale is not None or kv_dtype is not None
    if fp8_options:
        k_host, v_host = _fp8.host_scale("k_scale", k_scale), _fp8.host_scale("v_scale", v_scale)
        k_scale, v_scale = (None if h is not None else x for h, x in ((k_host, k_scale), (v_host, v_scale)))
    others = (seqlens, block_table, k_new, v_new, batch_idx, leftpad, slopes, cos, sin, k_scale, v_scale)
    found = _interop.lean_arrays(q, k_cache, v_cache, others)
    if found is None:
        given = (q, k_cache, v_cache, *others)
        if _interop.traced(given) or (k_new is not None and _interop.has_jax_arrays(given)):
            # JAX arrays are immutable: the custom call returns the appended caches (_jax).
            if fp8_options or "float8" in str(k_cache.dtype):
                raise NotImplementedError("attention_with_kvcache with a float8 cache does not run on JAX arrays yet")
            return _interop.jax_ops().attention_with_kvcache(
                dict(zip(_KV_NAMES, (q, k_cache, v_cache, cache_seqlens, *others[1:]))),
                (causal, scale, window, softcap), check_num_splits(num_splits), rotary, return_lse,
            )  # fmt: skip
        arrays = _interop.gpu_arrays(_KV_NAMES, given)
        if arrays is None:
            p = _problem(
                q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, (causal, scale, window, softcap),
                batch_idx, leftpad, slopes, (cos, sin, rotary),
            )  # fmt: skip
            out, lse = _host.attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, p, check_num_splits(num_splits),
                batch_idx, leftpad, slopes, cos, sin,
                fp8=_host_fp8(q, k_cache, v_cache, k_new, v_new, kv_dtype, k_scale if k_host is None else k_host,
                              v_scale if v_host is None else v_host),
            )  # fmt: skip
            return (out, lse) if return_lse else out
        lib, device, gpu = arrays
        q, k_cache, v_cache, seqlens, block_table, k_new, v_new, batch_idx, leftpad, slopes, cos, sin = gpu[:12]
        k_scale, v_scale = gpu[12:]
        if lib.name == _interop.DLPACK and k_new is not None:
            raise TypeError(
                "attention_with_kvcache with k_new on the GPU takes CuPy arrays, PyTorch tensors or JAX arrays (the "
                f"cache is written in place), got {type(q).__module__}.{type(q).__name__}"
            )
    else:
        lib, device = found
    if lib.check_inputs((q, k_cache, v_cache) if k_new is None else (q, k_cache, v_cache, k_new, v_new)):
        _interop.refuse_autograd("attention_with_kvcache")
    arrays_by_name = {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens if seqlens is None else seqlens,
        "block_table": block_table, "k_new": k_new, "v_new": v_new, "cache_batch_idx": batch_idx,
        "cache_leftpad": leftpad, "alibi_slopes": slopes, "rotary_cos": cos, "rotary_sin": sin,
        "k_scale": k_scale if k_host is None else k_host, "v_scale": v_scale if v_host is None else v_host,
    }  # fmt: skip
    out, lse = gpu_attention_with_kvcache(
        lib, device, arrays_by_name, (causal, scale, window, softcap), num_splits, rotary, return_lse,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def gpu_attention_with_kvcache(
    lib: _interop.ArrayLib, device: int, arrays: dict[str, Any], options: tuple[bool, Any, tuple[int, int], float],
    num_splits: int, rotary: bool | None, want_lse: bool, given: Any = _launch.EMPTY, kv_dtype: str | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """The kernels of a cache call on arrays the pipeline reads, by name (``_KV_NAMES``; the
    caches are appended in place): (out, lse), lse None unless wanted. ``given``: output buffers
    to write, by name (``_launch.run``; XLA's under ``jax.jit``). A float8 cache's scales are
    arrays (operands) or host floats (checked, passed per call); ``kv_dtype`` names its format
    for caches of bytes (CuPy's uint8)."""
    q, k_cache, v_cache, seqlens, table, k_new, v_new, batch_idx, leftpad, slopes, cos, sin, k_scale, v_scale = (
        _kv_operands(arrays)
    )
    fp8_key = None  # a host float scale keys as "host": its value goes to the kernel per call
    if kv_dtype is not None or k_scale is not None or v_scale is not None:
        forms = ("host" if type(x) is float else None if x is None else (x.shape, x.dtype) for x in (k_scale, v_scale))
        fp8_key = (kv_dtype, *forms)
    # The signature, flat (a decode step builds it every call): what the plan depends on.
    key = (
        lib.name, device, *options, num_splits, q.shape, q.dtype, k_cache.shape, k_cache.dtype, v_cache.shape,
        v_cache.dtype, None if type(seqlens) is int else (seqlens.shape, seqlens.dtype),
        None if table is None else (table.shape, table.dtype), None if k_new is None else (k_new.shape, k_new.dtype),
        None if v_new is None else v_new.shape, None if batch_idx is None else (batch_idx.shape, batch_idx.dtype),
        None if leftpad is None else (leftpad.shape, leftpad.dtype),
        None if slopes is None else (slopes.shape, slopes.dtype),
        None if cos is None else (cos.shape, cos.dtype, sin.shape, sin.dtype, rotary), fp8_key,
    )  # fmt: skip
    launch = _plans.lookup(key)
    if launch is None:
        launch = _plans.get(
            key,
            lambda: _plan_kvcache(
                lib,
                device,
                q,
                k_cache,
                v_cache,
                seqlens,
                table,
                k_new,
                v_new,
                options,
                num_splits,
                batch_idx,
                leftpad,
                slopes,
                (cos, sin, rotary),
                (kv_dtype, k_scale, v_scale),
            ),  # fmt: skip
        )
    return _launch.run(launch, lib, device, arrays, want_lse, given)


def _problem(
    q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any,
    options: tuple[bool, Any, tuple[int, int], float], batch_idx: Any, leftpad: Any, slopes: Any = None,
    rotary: tuple[Any, Any, Any] = (None, None, None),
) -> Any:  # fmt: skip
    """``options``: (causal, scale, window, softcap), checked; ``rotary``: (cos, sin, interleaved)."""

    def shape(x: Any) -> tuple[int, ...] | None:
        return None if x is None else tuple(x.shape)

    causal, scale, window, softcap = options
    kp = kvcache_problem(
        tuple(q.shape), tuple(k_cache.shape), tuple(v_cache.shape), cache_seqlens=seqlens,
        block_table_shape=shape(table), k_new_shape=shape(k_new), v_new_shape=shape(v_new), causal=causal,
        scale=scale, cache_batch_idx_shape=shape(batch_idx), cache_leftpad_shape=shape(leftpad), window=window,
        softcap=softcap, rotary_shapes=None if rotary[0] is None else (rotary[0].shape, rotary[1].shape),
        rotary_interleaved=rotary[2],
    )  # fmt: skip
    if slopes is None:
        return kp
    alibi = check_alibi(slopes, kp.attn.batch, kp.attn.heads_q)
    return dataclasses.replace(kp, attn=dataclasses.replace(kp.attn, alibi=alibi))


def _plan_kvcache(
    lib: _interop.ArrayLib, device: int, q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any,
    v_new: Any, options: tuple[bool, Any, tuple[int, int], float], num_splits: int, batch_idx: Any, leftpad: Any,
    slopes: Any, rotary: tuple[Any, Any, Any], fp8_args: tuple[Any, Any, Any] = (None, None, None),
) -> _plan.Launch:  # fmt: skip
    # An int cache_seqlens is checked per call (the plan is shared by every int): plan with 0.
    p = _problem(
        q, k_cache, v_cache, 0 if type(seqlens) is int else seqlens, table, k_new, v_new, options, batch_idx, leftpad,
        slopes, rotary,
    )  # fmt: skip
    named = {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
        "cache_seqlens": None if type(seqlens) is int else seqlens, "block_table": table,
        "cache_batch_idx": batch_idx, "cache_leftpad": leftpad, "rotary_cos": rotary[0], "rotary_sin": rotary[1],
    }  # fmt: skip
    dtypes: dict[str, str | None] = {n: None if x is None else lib.dtype_name(x) for n, x in named.items()}
    if slopes is not None and lib.dtype_name(slopes) != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {lib.dtype_name(slopes)}")
    fp8 = _gpu_fp8(lib, dtypes, p.attn.heads_kv, *fp8_args)
    return _plan.plan_kvcache(p, dtypes, _device.device_info(device), num_splits=check_num_splits(num_splits), fp8=fp8)


def _refuse_fp8_queries(named: dict[str, str | None]) -> None:
    for name, dtype in named.items():
        if dtype is not None and dtype.startswith("float8"):
            raise TypeError(f"{name} is {dtype}: only the KV cache may be float8 (queries and new tokens stay 16-bit)")


def _gpu_fp8(
    lib: _interop.ArrayLib, dtypes: dict[str, str | None], heads_kv: int, kv_dtype: Any, k_scale: Any, v_scale: Any
) -> _fp8.Fp8Cache | None:
    """The float8 cache of a GPU call (None for caches of q's type), its scales' forms checked."""
    _refuse_fp8_queries({n: dtypes.get(n) for n in ("q", "k_new", "v_new")})
    k_dtype, v_dtype = dtypes["k_cache"] or "", dtypes["v_cache"] or ""
    fmt = _fp8.cache_format(k_dtype, v_dtype, kv_dtype)
    if fmt is None:
        _fp8.refuse_scales_without_fp8(k_scale, v_scale, k_dtype)
        return None
    forms = [  # None (1.0) and host floats go to the kernel per call
        "host" if x is None or type(x) is float else _fp8.scale_form(name, tuple(x.shape), lib.dtype_name(x), heads_kv)
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale))
    ]
    return _fp8.Fp8Cache(fmt, *forms)


def _host_fp8(
    q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any, kv_dtype: Any, k_scale: Any, v_scale: Any
) -> tuple[str, Any, Any] | None:
    """(format, k_scale, v_scale) of float8 host caches, or None for caches of q's type."""
    names = {"q": q, "k_new": k_new, "v_new": v_new}
    _refuse_fp8_queries({n: None if x is None else _fp8.dtype_name(x) for n, x in names.items()})
    k_dtype, v_dtype = _fp8.dtype_name(k_cache), _fp8.dtype_name(v_cache)
    fmt = _fp8.cache_format(k_dtype, v_dtype, kv_dtype)
    if fmt is None:
        _fp8.refuse_scales_without_fp8(k_scale, v_scale, k_dtype)
        return None
    return fmt, k_scale, v_scale


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Exact merge of two attention states over disjoint key sets (the basis of cascade and
    context-parallel attention): with ``lse = log(exp(lse_a) + exp(lse_b))``,
    ``o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b``.

    Parameters
    ----------
    o_a, o_b : arrays ``(B, N, H, d)``, each normalised over its own keys (as ``attention``
        returns it); on the GPU float16, bfloat16 or float32, d a multiple of 32 up to 256.
    lse_a, lse_b : arrays ``(B, H, N)``, natural log, float32 (on the host float64 too); ``-inf``
        marks a row that saw no key (it weighs nothing, whatever its O holds; both empty gives 0
        and ``-inf``); NaN in either part gives NaN.

    Returns
    -------
    (o, lse) : o like ``o_a``, lse ``(B, H, N)`` (float32, or float64 for float64 host inputs)

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, n, 2, 8)).astype(np.float32) for n in (3, 10, 10))
    >>> o1, l1 = cupyflash.attention(q, k[:, :4], v[:, :4], return_lse=True)
    >>> o2, l2 = cupyflash.attention(q, k[:, 4:], v[:, 4:], return_lse=True)
    >>> o, lse = cupyflash.merge_states(o1, l1, o2, l2)
    >>> bool(np.allclose(o, cupyflash.attention(q, k, v), atol=1e-5))
    True
    """
    dims = merge_problem(o_a.shape, lse_a.shape, o_b.shape, lse_b.shape)
    arrays = _interop.gpu_arrays(("o_a", "lse_a", "o_b", "lse_b"), (o_a, lse_a, o_b, lse_b))
    if arrays is None:
        return _host.merge_states(o_a, lse_a, o_b, lse_b)
    lib, device, named = arrays
    dtypes = {n: lib.dtype_name(x) for n, x in zip(("o_a", "lse_a", "o_b", "lse_b"), named)}
    key = (lib.name, device, dims, *dtypes.values())
    launch = _merge_plans.get(key, lambda: _plan.plan_merge(dims, dtypes))
    # The kernel reads part b at a fixed distance from part a: run copies a part that is not
    # C-contiguous, so both share one layout.
    out, lse = _launch.run(launch, lib, device, dict(zip(("o_a", "lse_a", "o_b", "lse_b"), named)), True)
    return out, lse


class DeviceValueError(ValueError):
    """A device-side value given to ``attention_with_kvcache`` or ``attention_varlen`` (and its
    backward) was out of range (found by the kernels, reported by :func:`check_device_errors`)."""


# The bits of the device error word (kernels_cu/params.cuh: kBadPage ... kBadSharedCacheIndex).
_DEVICE_ERRORS = {
    1: "a block_table entry in use was outside [0, num_pages)",
    2: "a cache_seqlens value was outside [0, capacity - seqlen_new], a cache_leftpad value outside "
    "[0, cache_seqlens], or a packed sequence's key count (cu_seqlens_k over pages) beyond its block_table row",
    4: "a cache_batch_idx value was outside the cache's entries",
    8: "a cu_seqlens_q value was negative, decreasing or past the packed total (or cu_seqlens_q[0] was not 0)",
    16: "a cu_seqlens_k value was negative, decreasing or past the packed total (or cu_seqlens_k[0] was not 0)",
    32: "a seqused_k value was outside [0, its sequence's key count]",
    64: "a cache_batch_idx value named an entry that another sequence also names while k_new appends into it",
}


def check_device_errors(device: int | None = None) -> None:
    """Raise :class:`DeviceValueError` if a kernel on ``device`` (default: the current one) met
    an out-of-range device-side value since the last check: of ``attention_with_kvcache``
    (``cache_seqlens``, ``block_table``, ``cache_batch_idx``, ``cache_leftpad``), or of
    ``attention_varlen`` and ``attention_varlen_backward`` (``cu_seqlens_q`` / ``cu_seqlens_k``
    offsets that are negative, decreasing, past the packed total or not starting at 0, a
    ``seqused_k`` outside ``[0, key count]``; over pages: ``block_table``, a key count beyond its
    table row). The message names each kind of value met.

    The kernels cannot raise: they refuse the bad value instead and set a flag that this call
    reads and clears. A cache sequence's output rows and LSE are NaN and nothing is appended
    through it, so no other sequence's cache changes. A packed sequence with a bad value reads
    nothing through a bad range, computes nothing, and writes NaN over the rows it still has:
    with a bad ``cu_seqlens_k`` pair or ``seqused_k``, its query rows (O and LSE; in the
    backward dq, while its dk, dv stay 0, untouched). With a bad
    ``cu_seqlens_q`` pair it has no rows of its own (those offsets are what says which rows are
    its), so it writes nothing there: the rows keep 0 (LSE -inf, gradient 0) unless a sequence
    with a valid pair covers them. No value is ever read or
    written outside the arrays. It waits for the device (a synchronisation), so call it where a
    serving loop can afford one: after a step in debug runs, or every N steps.
    """
    from . import _workspace

    index = _interop.current_device() if device is None else device
    bits = _workspace.take_device_errors(index)
    if bits:
        found = [message for bit, message in _DEVICE_ERRORS.items() if bits & bit]
        raise DeviceValueError(f"a kernel on GPU {index}: " + "; ".join(found))
