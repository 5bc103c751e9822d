"""The public attention functions: ``attention``, ``attention_varlen`` and their backward twins.

Each is validate -> plan -> run: options are checked first (the same way on every call), the
arrays' library and device found by ``_interop``, a ``Launch`` looked up by the call's signature
or planned (``_plan``, pure), and ``_launch.run`` queues it on the caller's stream. Host arrays
run the array-API algorithms (``_host``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, overload

from . import _baselines_gpu, _device, _fp8_forward, _host, _interop, _launch, _plan
from ._validate import (
    attention_problem,
    check_algorithm,
    check_alibi,
    check_attn_mask,
    check_dropout,
    check_flag,
    check_options,
    varlen_problem,
)
from .xp_impl import Dropout

# The forward plans, by call signature (library, device, shapes, dtypes, options).
_plans = _plan.new_cache()


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
    deterministic: bool = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    alibi_slopes: Any = ...,
    attn_mask: Any = ...,
    q_descale: Any = ...,
    k_descale: Any = ...,
    v_descale: Any = ...,
    out_dtype: Any = ...,
    fp8_dtype: str | None = ...,
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
    deterministic: bool = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    alibi_slopes: Any = ...,
    attn_mask: Any = ...,
    q_descale: Any = ...,
    k_descale: Any = ...,
    v_descale: Any = ...,
    out_dtype: Any = ...,
    fp8_dtype: str | None = ...,
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
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    attn_mask: Any = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
    out_dtype: Any = None,
    fp8_dtype: str | None = None,
) -> Any:
    """Exact attention ``softmax(scale * q @ k^T + mask) @ v``.

    Parameters
    ----------
    q : array, ``(B, Nq, Hq, d)`` for ``layout="bshd"`` or ``(B, Hq, Nq, d)`` for ``"bhsd"``
        CuPy array, PyTorch tensor, any DLPack GPU array (JAX ...) or a host array of any
        array-API namespace (NumPy, array_api_strict, PyTorch CPU). Traced JAX arrays (inside
        ``jax.jit``, ``grad``, ``vmap``) make the call an XLA custom call with a backward.
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
        ``-1`` = unbounded. ``causal=True`` sets ``right = 0`` whatever ``window`` says (as flash-attn).
    softcap : float
        If > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    layout : {"bshd", "bhsd"}
    algorithm : {"auto", "fa2", "fa3", "decode", "fa1", "naive"}
        On the GPU (float16/bfloat16, any head_dim from 1 to 256: the kernel of the next tile
        width, the columns past the caller's zero): ``"fa2"``, the mma.sync kernel; ``"fa3"``, the
        Hopper kernel (wgmma + TMA; sm_90, head_dim a multiple of 8); ``"decode"``, the split-KV
        decode kernel (1 to 16 query tokens, no dropout or ALiBi); ``"auto"`` picks decode for one
        query token where it applies, else fa3 where it applies, else fa2.
        ``"fa1"`` (FlashAttention-1's loop order, head_dim 64, 128, 256, 512) and ``"naive"``
        (S and P materialised in HBM, any head_dim) are the baselines of docs/io_analysis.md.
        On the host every algorithm runs through ``cupyflash.xp_impl``.
    return_lse : bool
        Also return the log-sum-exp of each row, natural log, ``(B, Hq, Nq)``: float32 (float64
        for float64 host inputs). NaN in a row's visible scores gives NaN in its output and LSE.
    deterministic : bool
        For PyTorch tensors that require grad: the backward without atomic adds (bit-identical
        gradients run to run; see :func:`attention_backward`).
    dropout_p : float in [0, 1)
        Dropout on the attention probabilities, as SDPA's and flash-attn's ``dropout_p``: each
        element of ``softmax(...)`` is zeroed with probability ``p' = round(65536 p) / 65536``
        (a 16-bit draw: within 2^-17 of ``dropout_p``, which must be below 1 - 2^-17) and the
        kept ones are scaled by ``1 / (1 - p')``, so the expected output is exact; the LSE is
        that of the undropped softmax. The mask is a function of ``seed`` and the element's
        (batch, query head, row, key), the same on the GPU (the FA2 kernel: ``"auto"`` picks
        it; ``"fa3"`` and ``"decode"`` have no dropout) and on the host. Pass 0 at inference.
    seed : int, optional
        The dropout mask's seed, in [0, 2^64). None: a fresh one per call, from PyTorch's
        default generator for tensors (``torch.manual_seed`` reproduces it), else from Python's
        ``random``. Give the same seed to :func:`attention_backward` to differentiate the call
        (autograd does it for tensors that require grad). A call captured into a CUDA graph
        must give one: the seed is a launch parameter, so every replay of a graph repeats the
        captured call's mask. Inside a JAX transformation a seed is required and may also be a
        JAX integer array (0-d, or ``(2,)`` uint32: low and high words), an operand of the
        compiled program, so that each call can draw a fresh mask.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi, as flash-attn's: the score of query ``i`` and key ``j`` gains
        ``-slope * |i + Nk - Nq - j|`` (after the scale and softcap, before the mask), the slope
        of the query head (and batch entry). Same library and device as ``q``. On the GPU: the
        FA2 kernel (``"auto"`` picks it, with softcap too; ``"fa3"`` and ``"decode"`` have
        no ALiBi).
    attn_mask : array, optional
        SDPA's ``attn_mask``, broadcast to ``(B, Hq, Nq, Nk)`` axis by axis (2 to 4 dims, each
        full or 1, missing leading ones 1): boolean (True: the key takes part) or additive (q's
        dtype on the GPU; added to ``scale * q @ k^T``), together with ``causal``/``window``.
        A key-padding mask is ``(B, 1, 1, Nk)``. A row whose every key is masked outputs 0 with
        LSE ``-inf`` (SDPA's gives NaN). Same library and device as ``q``. On the GPU the FA2
        kernels read it in place (strides 0 on broadcast axes), forward and backward (the mask
        gets no gradient), at any head dim. Not with softcap or ALiBi.
    q_descale, k_descale, v_descale : optional
        The FP8 forward (FlashAttention-3's FP8 call): with q, k and v in float8 e4m3
        (``torch.float8_e4m3fn``, ml_dtypes' ``float8_e4m3fn``, or uint8 bytes with
        ``fp8_dtype="e4m3"``) the call computes ``softmax(scale (q_descale q) (k_descale k)^T)
        (v_descale v)``. Each descale is None (1), a positive number, or a float32 array of
        shape ``()``, ``(Hkv,)`` or ``(B, Hkv)`` (query head ``h`` takes KV head ``h // (Hq //
        Hkv)``'s). On the GPU: Hopper, head_dim 128, causal or not, no window, softcap, dropout,
        ALiBi or mask, and no backward; P is rounded to e4m3 for P V as FlashAttention-3 does
        (docs/fp8_forward.md: its accuracy). :func:`quantize_fp8` makes the inputs.
    out_dtype : {"bfloat16", "float16"}, optional
        The FP8 forward's output dtype (default bfloat16).
    fp8_dtype : {"e4m3"}, optional
        The float8 format of uint8 q, k, v (CuPy has no float8 dtype).

    Returns
    -------
    out : array like ``q`` (same library, device, dtype and layout; a fresh contiguous array)
    lse : float32 array ``(B, Hq, Nq)`` (float64 for float64 inputs), when ``return_lse``

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
    if _fp8_forward.is_fp8_call(q, (q_descale, k_descale, v_descale), fp8_dtype):
        return _fp8_forward.attention_fp8(
            q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout, algorithm=algorithm,
            return_lse=return_lse, dropout_p=dropout_p, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
            descales=(q_descale, k_descale, v_descale), out_dtype=out_dtype, fp8_dtype=fp8_dtype,
        )  # fmt: skip
    if out_dtype is not None:
        raise TypeError("out_dtype is the FP8 forward's (float8 q, k, v); other calls return q's dtype")
    if attn_mask is not None:
        return _masked_attention(
            q, k, v, attn_mask, check_options(causal, scale, window, softcap), layout, algorithm, return_lse,
            check_flag("deterministic", deterministic), dropout_p, seed, alibi_slopes,
        )  # fmt: skip
    if _interop.compiling():  # Dynamo traces the custom op, not this function's body
        return _interop.torch_ops.attention(
            q, k, v, causal, scale, window, softcap, layout, algorithm, return_lse, deterministic, dropout_p, seed,
            alibi_slopes,
        )  # fmt: skip
    options = check_options(causal, scale, window, softcap)
    if deterministic is not False and deterministic is not True:
        deterministic = check_flag("deterministic", deterministic)
    check_algorithm("attention", algorithm)
    found = None if alibi_slopes is not None else _interop.lean_arrays(q, k, v)
    if found is None and _interop.traced((q, k, v, alibi_slopes, seed)):  # under a JAX transformation
        return _interop.jax_ops().attention(
            q, k, v, options, layout, algorithm, return_lse, deterministic, dropout_p, seed, alibi_slopes
        )
    if dropout_p or seed is not None or type(dropout_p) is not float:  # the default skips the checks
        dropout_p, seed = check_dropout(dropout_p, seed)
    if alibi_slopes is not None:
        _interop.refuse_slope_grad(alibi_slopes)
    if found is None:
        arrays = _interop.gpu_arrays(("q", "k", "v", "alibi_slopes"), (q, k, v, alibi_slopes))
        if arrays is None:
            if _interop.needs_autograd((q, k, v)):
                return _interop.torch_ops.attention(
                    q, k, v, *options, layout, algorithm, return_lse, deterministic, dropout_p, seed, alibi_slopes
                )
            problem = _problem(q, k, v, options, layout, dropout_p, alibi_slopes)
            dropout = _host_dropout(q, dropout_p, seed)
            out, lse = _host.attention(q, k, v, problem, algorithm, dropout, alibi_slopes)
            return (out, lse) if return_lse else out
        lib, device, (q, k, v, alibi_slopes) = arrays
    else:
        lib, device = found
    if lib.check_inputs((q, k, v)):  # tensors that require grad: the custom op has the backward
        return _interop.torch_ops.attention(
            q, k, v, *options, layout, algorithm, return_lse, deterministic, dropout_p, seed, alibi_slopes
        )
    out, lse = gpu_attention(
        lib, device, q, k, v, options, layout, algorithm, dropout_p, seed, alibi_slopes, return_lse
    )
    return (out, lse) if return_lse else out


_MASKED_NAMES = ("q", "k", "v", "attn_mask")


def _masked_attention(
    q: Any, k: Any, v: Any, attn_mask: Any, options: tuple[Any, ...], layout: str, algorithm: str, return_lse: bool,
    deterministic: bool, dropout_p: float, seed: int | None, alibi_slopes: Any,
) -> Any:  # fmt: skip
    """attention with an attn_mask: the FA2 kernel with the mask as a score variant on the GPU."""
    if _interop.compiling():  # Dynamo traces the custom op, which takes the mask
        return _interop.torch_ops.attention(
            q, k, v, *options, layout, algorithm, return_lse, deterministic, dropout_p, seed, alibi_slopes, attn_mask
        )
    if _interop.traced((q, k, v, attn_mask)):
        raise NotImplementedError("attention with attn_mask does not run under a JAX transformation yet")
    check_algorithm("attention", algorithm)
    if algorithm not in ("auto", "fa2"):
        raise ValueError(f"attn_mask runs on the FA2 kernel: algorithm must be 'auto' or 'fa2', got {algorithm!r}")
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem, mask = _with_mask(_problem(q, k, v, options, layout, dropout_p, alibi_slopes), attn_mask)
    arrays = _interop.gpu_arrays(_MASKED_NAMES, (q, k, v, mask))
    if arrays[0].check_inputs((q, k, v)) if arrays is not None else _interop.needs_autograd((q, k, v)):
        return _interop.torch_ops.attention(
            q, k, v, *options, layout, algorithm, return_lse, deterministic, dropout_p, seed, alibi_slopes, mask
        )
    if arrays is None:
        out, lse = _host.attention(q, k, v, problem, algorithm, _host_dropout(q, dropout_p, seed), attn_mask=mask)
        return (out, lse) if return_lse else out
    lib, device, (q, k, v, mask) = arrays
    key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, mask.dtype, problem, layout, algorithm)

    def plan() -> _plan.Launch:
        dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
        _check_mask_dtype(lib, problem, mask, dtype)
        return _plan.plan_attention(problem, dtype, _device.device_info(device), algorithm, tuple(q.shape))

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "attn_mask": mask}
    if dropout_p:
        arrays_by_name["dropout_seed"] = _gpu_seed(lib, device, q, seed)
    out, lse = _launch.run(launch, lib, device, arrays_by_name, return_lse)
    return (out, lse) if return_lse else out


def _with_mask(problem: Any, attn_mask: Any) -> tuple[Any, Any]:
    """The problem with its (checked) attn_mask's kind and 4-D shape, and the mask as 4-D."""
    if attn_mask is None:
        return problem, None
    if not hasattr(attn_mask, "shape") or not hasattr(attn_mask, "dtype"):
        raise TypeError(f"attn_mask must be an array, got {type(attn_mask).__name__}")
    kind, shape = check_attn_mask(tuple(attn_mask.shape), "bool" in str(attn_mask.dtype), problem)
    mask = attn_mask if attn_mask.ndim == 4 else attn_mask.reshape(shape)
    return dataclasses.replace(problem, mask=kind, mask_shape=shape), mask


def _check_mask_dtype(lib: _interop.ArrayLib, problem: Any, mask: Any, dtype: str) -> None:
    if problem.mask == "additive" and lib.dtype_name(mask) != dtype:
        raise TypeError(
            f"an additive attn_mask must have q's dtype {dtype} on the GPU (as SDPA's), got {lib.dtype_name(mask)}"
        )


def gpu_attention(
    lib: _interop.ArrayLib, device: int, q: Any, k: Any, v: Any, options: tuple[Any, ...], layout: str,
    algorithm: str, dropout_p: float, seed: int | None, alibi_slopes: Any, want_lse: bool,
    given: Any = _launch.EMPTY,
) -> tuple[Any, Any]:  # fmt: skip
    """The kernels' forward on arrays the pipeline reads (checked options): (out, lse), lse None
    unless wanted. ``given``: output buffers to write, by name (``_launch.run``)."""
    alibi_key = None if alibi_slopes is None else (tuple(alibi_slopes.shape), alibi_slopes.dtype)
    key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, options, layout, algorithm,
           dropout_p, alibi_key)  # fmt: skip
    launch = _plans.lookup(key)
    if launch is None:
        launch = _plans.get(
            key, lambda: _plan_attention(lib, device, q, k, v, options, layout, algorithm, dropout_p, alibi_slopes)
        )
    arrays_by_name = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes}
    if dropout_p:
        arrays_by_name["dropout_seed"] = _gpu_seed(lib, device, q, seed)
    return _launch.run(launch, lib, device, arrays_by_name, want_lse, given)


def _gpu_seed(lib: _interop.ArrayLib, device: int, x: Any, seed: int | None) -> int:
    """The seed of a GPU call with dropout: the caller's, or a fresh one (never under capture)."""
    if seed is not None:
        return seed
    if _interop.stream_is_capturing(lib.stream(device)):
        raise _interop.dropout_capture_error()
    return _interop.draw_seed(x)


def _host_dropout(x: Any, dropout_p: float, seed: int | None) -> Dropout | None:
    if not dropout_p:
        return None
    return Dropout(dropout_p, _interop.draw_seed(x) if seed is None else seed)


def _problem(
    q: Any, k: Any, v: Any, options: tuple[Any, ...], layout: str, dropout_p: float = 0.0, alibi_slopes: Any = None
) -> Any:
    causal, scale, window, softcap = options
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array (CuPy, PyTorch, JAX, NumPy ...), got {type(x).__name__}")
    problem = attention_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), causal=causal, scale=scale, window=window, softcap=softcap,
        layout=layout, dropout_p=dropout_p,
    )  # fmt: skip
    return _with_alibi(problem, alibi_slopes)


def _with_alibi(problem: Any, alibi_slopes: Any) -> Any:
    """The problem with the kind of its (checked) ALiBi slopes, against its batch and heads."""
    if alibi_slopes is None:
        return problem
    return dataclasses.replace(problem, alibi=check_alibi(alibi_slopes, problem.batch, problem.heads_q))


def _varlen_problem(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, options: tuple[Any, ...],
    dropout_p: float = 0.0, alibi_slopes: Any = None, seqused_k: Any = None, block_table: Any = None,
) -> Any:  # fmt: skip
    problem = varlen_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(cu_q.shape), tuple(cu_k.shape), max_q, max_k,
        causal=options[0], scale=options[1], window=options[2], softcap=options[3], dropout_p=dropout_p,
        seqused_k_shape=None if seqused_k is None else tuple(seqused_k.shape),
        block_table_shape=None if block_table is None else tuple(block_table.shape),
    )  # fmt: skip
    return _with_alibi(problem, alibi_slopes)


def _plan_attention(
    lib: _interop.ArrayLib, device: int, q: Any, k: Any, v: Any, options: tuple[Any, ...], layout: str, algorithm: str,
    dropout_p: float, alibi_slopes: Any,
) -> _plan.Launch:  # fmt: skip
    problem = _problem(q, k, v, options, layout, dropout_p, alibi_slopes)
    dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
    _check_slopes_dtype(lib, alibi_slopes)
    if algorithm in ("fa1", "naive"):
        if dropout_p or alibi_slopes is not None:
            raise ValueError(f"the GPU baseline algorithm={algorithm!r} has no dropout or ALiBi: use 'auto' or 'fa2'")
        return _baselines_gpu.plan_baseline(problem, dtype, _device.device_info(device), algorithm)
    return _plan.plan_attention(problem, dtype, _device.device_info(device), algorithm, tuple(q.shape))


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
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    seqused_k: Any = None,
    block_table: Any = None,
) -> Any:
    """Attention over a batch of sequences of different lengths packed end to end, as
    flash-attn's ``flash_attn_varlen_func``.

    Parameters
    ----------
    q : array ``(total_q, Hq, d)``; sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    k, v : arrays ``(total_k, Hkv, d)``, split by ``cu_seqlens_k``; with ``block_table``, pages
        ``(num_pages, page_size, Hkv, d)`` of a paged KV cache (``page_size`` a power of two)
    cu_seqlens_q, cu_seqlens_k : int32 arrays ``(batch + 1,)``, starting at 0, non-decreasing,
        on the same device as ``q``; with ``block_table``, ``cu_seqlens_k`` gives each sequence's
        key count only
    max_seqlen_q, max_seqlen_k : int
        The longest query / key sequence. They size the grid and nothing else: the mask always
        comes from ``causal``/``window``. On the GPU they must not be understated (rows past
        ``max_seqlen_q`` of a longer sequence are not computed); on the host they are checked.
    causal, scale, window, softcap : as in :func:`attention`, per sequence (bottom-right causal
        within each sequence).
    return_lse : bool
        Also return the LSE, shape ``(Hq, total_q)``: float32 (float64 for float64 host inputs).
    algorithm : {"auto", "fa2", "fa3"}
        The GPU kernel. "auto" is the Hopper kernel where it applies (sm_90, a head_dim that is a
        multiple of 8),
        else the mma.sync FA2 kernel; "fa2" and "fa3" force one (as :func:`attention`). On the
        host every choice runs ``cupyflash.xp_impl``'s FA2.
    deterministic : bool
        For PyTorch tensors that require grad: the backward without atomic adds.
    dropout_p, seed : as in :func:`attention`; an element's (batch, row, key) are its sequence's
        index and its positions within the sequence.
    alibi_slopes : as in :func:`attention`, ``(Hq,)`` or ``(batch, Hq)``; the distance within
        each sequence.
    seqused_k : int32 array ``(batch,)``, optional
        flash-attn's: only the first ``seqused_k[b]`` keys of sequence ``b`` take part (its causal
        alignment counts those), e.g. a cache region preallocated per sequence. On the GPU the FA2
        kernel (``"auto"`` picks it); checked on the device like the offsets (Notes).
    block_table : int32 array ``(batch, max_pages)``, optional
        Paged keys (chunked prefill against a paged cache, as serving engines run it): key ``j``
        of sequence ``b`` is slot ``j % page_size`` of page ``block_table[b, j // page_size]``.
        On the GPU the FA2 kernel reads the pages in place; its device values are checked there
        as :func:`attention_with_kvcache`'s: a page id in use outside ``[0, num_pages)``, or a key
        count (from ``cu_seqlens_k`` / ``seqused_k``) that is negative or beyond the sequence's
        table row, makes that sequence's rows NaN and :func:`check_device_errors` raise. No
        dropout, no gradients, not under ``torch.compile`` yet.

    Notes
    -----
    On the GPU the offsets are not read back to the host (that would synchronise the device on
    every call, and break CUDA-graph capture): the kernels check each sequence's own pair as
    they read it. A sequence ``b`` whose ``cu_seqlens_k`` pair is bad (negative, decreasing,
    past ``total_k``, or a first offset other than 0) or whose ``seqused_k[b]`` is outside
    ``[0, its key count]`` reads no key and gets NaN output rows (and NaN LSE) over its query
    rows. One whose ``cu_seqlens_q`` pair is bad (the same, against ``total_q``) has no rows of
    its own, since those offsets are what says which rows are its: it writes nothing, and those
    rows keep 0 (LSE ``-inf``) unless a sequence with a valid pair covers them. Either way no
    value is read or written outside the arrays, rows of sequences whose pairs are valid are
    computed as usual, and :func:`check_device_errors` raises :class:`DeviceValueError` naming
    ``cu_seqlens_q``, ``cu_seqlens_k`` or ``seqused_k`` (a bad pair in ``cu_seqlens_q`` can make
    two valid-looking pairs overlap, as in ``[0, 10, 5, 20]``: the flag is the signal, check it).
    Host arrays are checked in full before anything is computed (``ValueError``).

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> q = k = v = np.ones((7, 2, 16), dtype=np.float32)
    >>> cu = np.array([0, 3, 7], dtype=np.int32)
    >>> cupyflash.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).shape
    (7, 2, 16)
    """
    if block_table is not None:
        options = check_options(causal, scale, window, softcap)
        return _paged_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, return_lse, algorithm,
            dropout_p, alibi_slopes, seqused_k, block_table,
        )  # fmt: skip
    if _interop.compiling():
        return _interop.torch_ops.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
            algorithm, return_lse, deterministic, dropout_p, seed, alibi_slopes, seqused_k,
        )  # fmt: skip
    options = check_options(causal, scale, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    dropout_p, seed = check_dropout(dropout_p, seed)
    if alibi_slopes is not None:
        _interop.refuse_slope_grad(alibi_slopes)
    check_algorithm("attention_varlen", algorithm)
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "seqused_k")
    arrays = _interop.gpu_arrays(names, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_k))
    if arrays[0].check_inputs((q, k, v)) if arrays is not None else _interop.needs_autograd((q, k, v)):
        return _interop.torch_ops.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options, algorithm, return_lse,
            deterministic, dropout_p, seed, alibi_slopes, seqused_k,
        )  # fmt: skip
    problem = _varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, dropout_p, alibi_slopes, seqused_k
    )
    if arrays is None:
        dropout = _host_dropout(q, dropout_p, seed)
        out, lse = _host.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, problem, dropout, alibi_slopes, seqused_k
        )
        return (out, lse) if return_lse else out
    lib, device, (q, k, v, cu_q, cu_k, alibi_slopes, seqused_k) = arrays
    key = (lib.name, device, problem, q.shape, k.shape, _dtypes(q, k, v, cu_q, cu_k, alibi_slopes, seqused_k),
           algorithm)  # fmt: skip

    def plan() -> _plan.Launch:
        dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
        _plan.check_int32({"cu_seqlens_q": lib.dtype_name(cu_q), "cu_seqlens_k": lib.dtype_name(cu_k),
                           "seqused_k": None if seqused_k is None else lib.dtype_name(seqused_k)})  # fmt: skip
        _check_slopes_dtype(lib, alibi_slopes)
        rows = (q.shape[0], k.shape[0])
        return _plan.plan_forward(
            problem, dtype, _device.device_info(device), algorithm, q_shape=tuple(q.shape), packed_rows=rows
        )

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "alibi_slopes": alibi_slopes,
                      "seqused_k": seqused_k}  # fmt: skip
    if dropout_p:
        arrays_by_name["dropout_seed"] = _gpu_seed(lib, device, q, seed)
    out, lse = _launch.run(launch, lib, device, arrays_by_name, return_lse)
    return (out, lse) if return_lse else out


_PAGED_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "seqused_k", "block_table")


def _paged_varlen(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, options: tuple[Any, ...], return_lse: bool,
    algorithm: str, dropout_p: float, alibi_slopes: Any, seqused_k: Any, block_table: Any,
) -> Any:  # fmt: skip
    """attention_varlen over a paged cache: the FA2 kernel over the cache view on the GPU."""
    if _interop.compiling():
        raise NotImplementedError("attention_varlen with a block_table does not run under torch.compile yet")
    check_algorithm("attention_varlen", algorithm)
    if algorithm == "fa3":
        raise ValueError("algorithm='fa3' (the Hopper kernel) does not read paged keys: use 'auto' or 'fa2'")
    if alibi_slopes is not None:
        _interop.refuse_slope_grad(alibi_slopes)
    given = (q, k, v, cu_q, cu_k, alibi_slopes, seqused_k, block_table)
    arrays = _interop.gpu_arrays(_PAGED_NAMES, given)
    if arrays[0].check_inputs((q, k, v)) if arrays is not None else _interop.needs_autograd((q, k, v)):
        _interop.refuse_autograd("attention_varlen with a block_table")
    problem = _varlen_problem(
        q, k, v, cu_q, cu_k, max_q, max_k, options, dropout_p, alibi_slopes, seqused_k, block_table
    )
    if arrays is None:
        out, lse = _host.attention_varlen(
            q, k, v, cu_q, cu_k, problem, None, alibi_slopes, seqused_k, block_table=block_table
        )
        return (out, lse) if return_lse else out
    lib, device, named = arrays
    q, k, v, cu_q, cu_k, alibi_slopes, seqused_k, block_table = named
    key = (lib.name, device, problem, q.shape, k.shape, block_table.shape, _dtypes(*named), "paged")

    def plan() -> _plan.Launch:
        dtypes = {n: None if x is None else lib.dtype_name(x) for n, x in zip(_PAGED_NAMES, named)}
        _check_slopes_dtype(lib, alibi_slopes)
        return _plan.plan_paged_varlen(
            problem, dtypes, _device.device_info(device), tuple(q.shape), tuple(block_table.shape), k.shape[0]
        )

    launch = _plans.get(key, plan)
    out, lse = _launch.run(launch, lib, device, dict(zip(_PAGED_NAMES, named)), return_lse)
    return (out, lse) if return_lse else out


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    dlse: Any = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    layout: str = "bshd",
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    attn_mask: Any = None,
) -> tuple[Any, Any, Any]:
    """The gradients (dq, dk, dv) of :func:`attention` at ``out, lse = attention(q, k, v, ...,
    return_lse=True)`` for the output gradient ``dout``, as FlashAttention-2's backward computes
    them: P recomputed from q, k and ``lse`` block by block (nothing N x N is kept),
    ``D = rowsum(dout * out)``, ``dS = P * (dout v^T - D)`` (times the softcap's derivative),
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dout``; with GQA, dk and dv summed
    over the query heads that read each key/value head.

    Parameters
    ----------
    dout, out : arrays shaped like ``q``
    q, k, v, causal, scale, window, softcap, layout : as for :func:`attention`
    lse : ``(B, Hq, Nq)`` float32, as :func:`attention` returns it
    dlse : optional, like ``lse``: the gradient of the returned LSE, where a loss uses it
        (``dS`` gains ``P * dlse``)
    deterministic : bool
        On the GPU, dq bit-identical from run to run. On Hopper (head_dim 64 and 128, padded
        batches without dropout, ALiBi or a mask) the key blocks add into each dq tile in one
        fixed order (0-13% slower than the default on the H200); elsewhere a second kernel over
        query blocks recomputes the scores (two more matrix products). The host path is
        deterministic either way.
    dropout_p, seed : the forward's (its mask is regenerated from the seed, which is required
        when ``dropout_p > 0``): ``dv = (P M r)^T dout``, ``dS = P * (dout v^T M r - D)`` with
        M the keep mask and ``r`` the forward's scale of the kept values.
    alibi_slopes : the forward's (the slopes get no gradient, as in flash-attn).
    attn_mask : the forward's (it gets no gradient; a masked score's dS is 0).

    Returns
    -------
    (dq, dk, dv) : arrays like ``q``, ``k``, ``v`` (fresh and contiguous on the GPU)

    Notes
    -----
    GPU arrays (float16/bfloat16, head_dim 1 to 256) run the mma.sync backward of
    ``kernels_cu/fa2_bwd.cu`` on the caller's stream (on Hopper the key-block step of
    ``kernels_cu/fa3_bwd.cu`` where it has the variant); dq is accumulated in float32 with
    atomic adds, so its last bits can differ from run to run (unless ``deterministic``). Host arrays
    run the array-API algorithm (``cupyflash.xp_impl.attention_backward``) in their own
    namespace.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, n, 2, 16)) for n in (5, 7, 7))
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape
    ((1, 5, 2, 16), (1, 7, 2, 16))
    """
    options = check_options(causal, scale, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    dropout_p, seed = _backward_dropout(dropout_p, seed)
    problem, mask = _with_mask(_problem(q, k, v, options, layout, dropout_p, alibi_slopes), attn_mask)
    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "alibi_slopes", "attn_mask")
    given = (dout, q, k, v, out, lse, dlse, alibi_slopes, mask)
    lse_shape = (problem.batch, problem.heads_q, problem.seqlen_q)
    _check_shapes(given, names, (q.shape, q.shape, lse_shape, lse_shape), ("dout", "out", "lse", "dlse"))
    arrays = _interop.gpu_arrays(names, given)
    if arrays is None:
        dropout = Dropout(dropout_p, seed) if seed is not None else None
        return _host.attention_backward(dout, q, k, v, out, lse, dlse, problem, dropout, alibi_slopes, mask)
    lib, device, (dout, q, k, v, out, lse, dlse, alibi_slopes, mask) = arrays
    return gpu_attention_backward(
        lib, device, problem, dout, q, k, v, out, lse, dlse, deterministic, seed, alibi_slopes, attn_mask=mask
    )


def gpu_attention_backward(
    lib: _interop.ArrayLib, device: int, problem: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
    dlse: Any, deterministic: bool, seed: int | None, alibi_slopes: Any, given: Any = _launch.EMPTY,
    attn_mask: Any = None,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """The kernels' backward on arrays the pipeline reads (a checked ``problem``): (dq, dk, dv).
    ``given``: output buffers to write, by name (``_launch.run_outputs``)."""
    dtypes = _dtypes(q, k, v, out, dout, lse, dlse, alibi_slopes, attn_mask)
    key = ("bwd", lib.name, device, problem, q.shape, k.shape, dtypes, deterministic)

    def plan() -> _plan.Launch:
        _check_slopes_dtype(lib, alibi_slopes)
        dtype = _backward_dtypes(lib, q, k, v, out, dout, lse, dlse)
        _check_mask_dtype(lib, problem, attn_mask, dtype)
        return _plan.plan_backward(
            problem, dtype, _device.device_info(device), q_shape=tuple(q.shape), k_shape=tuple(k.shape),
            deterministic=deterministic,
        )  # fmt: skip

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse,
                      "dropout_seed": seed, "alibi_slopes": alibi_slopes, "attn_mask": attn_mask}  # fmt: skip
    dq, dk, dv = _launch.run_outputs(launch, lib, device, arrays_by_name, given)
    return dq, dk, dv


def attention_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dlse: Any = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    seqused_k: Any = None,
) -> tuple[Any, Any, Any]:
    """The gradients (dq, dk, dv) of :func:`attention_varlen` at ``out, lse =
    attention_varlen(..., return_lse=True)``, as :func:`attention_backward` computes them, per
    packed sequence. ``lse`` (and ``dlse``) are ``(Hq, total_q)``. Packed rows that belong to
    no sequence get zero gradients. On the GPU the offsets and ``seqused_k`` are checked on the
    device as the forward's and a bad one is reported (:func:`check_device_errors` raises): a
    sequence whose keys are bad gets NaN dq over its query rows (from the NaN ``lse`` rows the
    forward gave it, which autograd passes); the key-block kernel reads the offsets clamped into
    the tensors, so a bad sequence's dk, dv are undefined and may reach the rows its clamped
    range covers, never outside the tensors. On the host they are checked. ``dropout_p`` and ``seed``:
    the forward's, as for :func:`attention_backward`; ``alibi_slopes`` and ``seqused_k`` too (keys
    past ``seqused_k`` get zero gradients)."""
    options = check_options(causal, scale, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    dropout_p, seed = _backward_dropout(dropout_p, seed)
    problem = _varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, dropout_p, alibi_slopes, seqused_k
    )
    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "seqused_k")
    given = (dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_k)
    lse_shape = (problem.heads_q, q.shape[0])
    _check_shapes(given, names, (q.shape, q.shape, lse_shape, lse_shape), ("dout", "out", "lse", "dlse"))
    arrays = _interop.gpu_arrays(names, given)
    if arrays is None:
        dropout = Dropout(dropout_p, seed) if seed is not None else None
        return _host.attention_varlen_backward(
            dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, problem, dropout, alibi_slopes, seqused_k
        )
    lib, device, (dout, q, k, v, out, lse, dlse, cu_q, cu_k, alibi_slopes, seqused_k) = arrays
    dtypes = _dtypes(q, k, v, out, dout, lse, dlse, cu_q, cu_k, alibi_slopes, seqused_k)
    key = ("bwd_varlen", lib.name, device, problem, q.shape, k.shape, dtypes, deterministic)

    def plan() -> _plan.Launch:
        dtype = _backward_dtypes(lib, q, k, v, out, dout, lse, dlse)
        _plan.check_int32({"cu_seqlens_q": lib.dtype_name(cu_q), "cu_seqlens_k": lib.dtype_name(cu_k),
                           "seqused_k": None if seqused_k is None else lib.dtype_name(seqused_k)})  # fmt: skip
        _check_slopes_dtype(lib, alibi_slopes)
        return _plan.plan_backward(
            problem, dtype, _device.device_info(device), q_shape=tuple(q.shape), k_shape=tuple(k.shape),
            packed_rows=(q.shape[0], k.shape[0]), deterministic=deterministic,
        )  # fmt: skip

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse,
                      "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "dropout_seed": seed,
                      "alibi_slopes": alibi_slopes, "seqused_k": seqused_k}  # fmt: skip
    dq, dk, dv = _launch.run_outputs(launch, lib, device, arrays_by_name)
    return dq, dk, dv


def _dtypes(*arrays: Any) -> tuple[Any, ...]:
    """Every array's dtype for a plan key (None for an absent optional array): a plan checks the
    dtypes once, so a call whose dtypes differ must not find it."""
    return tuple(None if x is None else x.dtype for x in arrays)


def _check_slopes_dtype(lib: _interop.ArrayLib, slopes: Any) -> None:
    if slopes is not None and lib.dtype_name(slopes) != "float32":
        raise TypeError(f"alibi_slopes must be float32 (as flash-attn's), got {lib.dtype_name(slopes)}")


def _backward_dropout(dropout_p: Any, seed: Any) -> tuple[float, int | None]:
    """The forward's dropout, checked; its seed is required (the mask is regenerated from it)."""
    dropout_p, seed = check_dropout(dropout_p, seed)
    if dropout_p and seed is None:
        raise ValueError("a backward with dropout_p > 0 needs the forward's seed= (its mask is regenerated from it)")
    return dropout_p, seed if dropout_p else None


def _check_shapes(
    given: tuple[Any, ...], names: tuple[str, ...], shapes: tuple[Any, ...], which: tuple[str, ...]
) -> None:
    by_name = dict(zip(names, given))
    for name, shape in zip(which, shapes):
        x = by_name[name]
        if x is None:
            continue
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array (CuPy, PyTorch, JAX, NumPy ...), got {type(x).__name__}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _backward_dtypes(lib: _interop.ArrayLib, q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, dlse: Any) -> str:
    dtype = _plan.check_gpu_dtypes({n: lib.dtype_name(x) for n, x in
                                    (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout))})  # fmt: skip
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is not None and lib.dtype_name(x) != "float32":
            raise TypeError(f"{name} must be float32 (as attention returns the LSE), got {lib.dtype_name(x)}")
    return dtype
