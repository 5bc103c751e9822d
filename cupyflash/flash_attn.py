"""flash-attn's interface over cupyflash: the same function names, argument order, defaults and
return forms as ``flash_attn`` 2.x (``flash_attn_func``, ``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func``, their varlen twins and ``flash_attn_with_kvcache``), so that a
flash-attn user changes one import line::

    from cupyflash.flash_attn import flash_attn_func, flash_attn_with_kvcache

Each function maps its arguments onto :func:`cupyflash.attention`,
:func:`cupyflash.attention_varlen` or :func:`cupyflash.attention_with_kvcache` and takes what
those take: CuPy, PyTorch, JAX or host arrays. PyTorch tensors that require grad get their
gradients (``deterministic`` is honoured), as with flash-attn. ``dropout_p`` drops attention
probabilities as flash-attn's does (in training; pass 0 at evaluation, as flash-attn asks), with
a seed from PyTorch's default generator (``torch.manual_seed`` reproduces it).

Semantics taken from flash-attn: ``causal=True`` sets the window's right bound to 0 (whatever
``window_size[1]`` says), ``softmax_scale=None`` is ``1 / sqrt(headdim)``, ``softmax_lse`` is
float32 ``(batch, nheads, seqlen_q)`` (``(nheads, total_q)`` for varlen), ``cache_seqlens=None``
reads the whole cache.

flash-attn 2.8's lower-level functions are here too, for the libraries built on flash-attn:
``_flash_attn_forward`` (returns ``out, softmax_lse, S_dmask, rng_state``), ``_flash_attn_backward``
(writes the caller's ``dq``, ``dk``, ``dv``, one copy each of the executor's fresh gradients, and
returns ``softmax_d``), their varlen twins, ``flash_attn_gpu`` (the compiled module's four entry
points in their C++ argument order) and ``_get_block_size_n``. :func:`install` presents this module
as ``flash_attn`` and ``flash_attn.flash_attn_interface`` (opt-in), so that ring-flash-attn's
context parallelism runs on cupyflash (ring, zigzag, stripe and llama3's varlen functions are
tested on virtual ranks)::

    import cupyflash.flash_attn
    cupyflash.flash_attn.install()          # before ring_flash_attn is imported
    from ring_flash_attn import zigzag_ring_flash_attn_func

``return_attn_probs=True`` (``return_softmax``) with dropout returns flash-attn's ``S_dmask``:
``(B, H, Sq, Sk)`` rounded up to multiples of 128, ``exp(s - m)`` against each key block's running
max (blocks of ``_get_block_size_n`` keys), negated where the mask drops the element, as flash-attn's
tests decode it. It is made on request on the host from the mask regenerated from the seed
(``cupyflash.xp_impl.dropout_pattern``): O(Sq Sk) memory and a copy of q and k to the host, for tests
and inspection only.

Differences that remain (each raises an error naming the argument, never a silent fallback, unless
said):
``block_table`` on the varlen functions has no dropout and no backward: the forward runs on inputs
that require grad, and a backward through it raises ``NotImplementedError`` (as flash-attn, which
has no paged backward either); ``leftpad_k`` of ``_flash_attn_varlen_forward`` is not supported;
``rotary_cos`` needs a row for every position of the cache (flash-attn's own rule) and any even
rotary dim is taken (flash-attn asks for a multiple of 16).
Without dropout, ``return_attn_probs=True`` returns ``None`` as the third value (flash-attn an empty
tensor). ``rng_state`` is ``[seed, 0]`` int64 on the host (flash-attn's is on the GPU), so the
backward reads it without a device synchronisation; a given one on the GPU is read back (one
synchronisation). ``softmax_d`` of the varlen backward holds the packed rows in order, then zeros
(flash-attn spaces the sequences 128 rows apart). ``zero_tensors`` and the varlen ``num_splits``
change nothing (rows outside every sequence are always 0).

Bad lengths and page ids raise ``RuntimeError`` in the call, naming the argument, as flash-attn's
(``flash_attn_with_kvcache``: ``cache_seqlens``, ``block_table``, ``cache_batch_idx``,
``cache_leftpad``; the varlen functions and ``_flash_attn_varlen_backward``: ``cu_seqlens_q``,
``cu_seqlens_k``, ``seqused_k``, ``block_table``), by the core API's host rules. For arrays on the
GPU that reads them back first: one device synchronisation per call, which the core API
(``cupyflash.attention_with_kvcache``, ``attention_varlen``) never makes. Where nothing can be read
back -- under ``torch.compile``, JAX tracing, CUDA-graph capture -- the check is skipped and a bad
value is reported as the core API reports it (on the GPU its rows become NaN and
``cupyflash.check_device_errors()`` raises). Offsets ending before the packed total are accepted
(the rows after them are 0), and a sequence longer than its ``max_seqlen`` raises.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _attention, _interop, xp_impl
from ._api import attention, attention_backward, attention_varlen, attention_varlen_backward, attention_with_kvcache
from ._kvcache import kvcache_problem_of
from ._validate import (
    Options,
    check_cu_seqlens_values,
    check_kvcache_values,
    check_paged_keys,
    check_seqused_values,
    check_window,
)
from .reference import to_numpy64

__all__ = [
    "USE_TRITON_ROCM",
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_get_block_size_n",
    "flash_attn_func",
    "flash_attn_gpu",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "uninstall",
]


def _window(causal: bool, window_size: Any) -> tuple[int, int]:
    """flash-attn's rule: causal means a right bound of 0, whatever the window says. Bounds may
    be 0-d integer tensors or NumPy arrays (taken as the ints they hold)."""
    left, right = check_window(window_size)
    return (left, 0) if causal else (left, right)


def _returned(out: Any, lse: Any, s_dmask: Any, return_attn_probs: bool) -> Any:
    return (out, lse, s_dmask) if return_attn_probs else out


def _fresh_seed(q: Any, dropout_p: Any, needed: bool = True) -> int | None:
    """The dropout mask's seed, drawn here (as ``attention`` would draw it: PyTorch's default
    generator for tensors) where the call hands it back (``rng_state``) or reads the mask again
    (``S_dmask``); else None, and ``attention`` draws its own. A seed drawn on the host would be a
    constant of a compiled graph or a captured CUDA graph (every replay repeating one mask), so
    those are refused here as ``attention`` refuses them."""
    if not dropout_p or not needed:
        return None
    if _interop.compiling():
        raise NotImplementedError(
            "flash-attn's rng_state / S_dmask with dropout under torch.compile: the seed would be a constant of the "
            "compiled graph; call it eagerly, or without return_attn_probs"
        )
    if _library(q) == "torch" and q.is_cuda and sys.modules["torch"].cuda.is_current_stream_capturing():
        raise _interop.dropout_capture_error()
    return _interop.draw_seed(q)


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]


# ---------------------------------------------------------------------------------------------
# Padded batches: (batch, seqlen, nheads, headdim).
# ---------------------------------------------------------------------------------------------
def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """q ``(B, Sq, H, d)``, k and v ``(B, Sk, Hk, d)``; returns out ``(B, Sq, H, d)``, or
    ``(out, softmax_lse, None)`` with ``return_attn_probs``."""
    window, seed = _window(causal, window_size), _fresh_seed(q, dropout_p, needed=return_attn_probs)
    out, lse = attention(
        q, k, v, causal=causal, scale=softmax_scale, window=window, softcap=softcap, return_lse=True,
        deterministic=deterministic, dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    s_dmask = None
    if return_attn_probs and dropout_p:
        s_dmask = _attn_probs(q, k, Options(causal, softmax_scale, window, softcap), dropout_p, seed, alibi_slopes)
    return _returned(out, lse, s_dmask, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """qkv ``(B, S, 3, H, d)``: :func:`flash_attn_func` on its three views (no copy)."""
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: Any,
    kv: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """q ``(B, Sq, H, d)``, kv ``(B, Sk, 2, Hk, d)``."""
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Packed sequences: (total, nheads, headdim) split by cu_seqlens.
# ---------------------------------------------------------------------------------------------
def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
) -> Any:
    """q ``(total_q, H, d)``, k and v ``(total_k, Hk, d)`` (pages ``(num_blocks, page_size, Hk, d)``
    with ``block_table``), cu_seqlens int32 ``(batch + 1,)``; ``softmax_lse`` is ``(H, total_q)``."""
    window, seed = _window(causal, window_size), _fresh_seed(q, dropout_p, needed=return_attn_probs)
    out, lse = _varlen_forward(
        "flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=softmax_scale, window=window, softcap=softcap, deterministic=deterministic, dropout_p=dropout_p,
        seed=seed, alibi_slopes=alibi_slopes, block_table=block_table,
    )  # fmt: skip
    s_dmask = None
    if return_attn_probs and dropout_p:
        options = Options(causal, softmax_scale, window, softcap)
        s_dmask = _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, (max_seqlen_q, max_seqlen_k), options,
                                     dropout_p, seed, alibi_slopes)  # fmt: skip
    return _returned(out, lse, s_dmask, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: Any,
    cu_seqlens: Any,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """qkv ``(total, 3, H, d)``, one cu_seqlens for queries and keys."""
    return flash_attn_varlen_func(
        qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: Any,
    kv: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """q ``(total_q, H, d)``, kv ``(total_k, 2, Hk, d)``."""
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Decoding over a KV cache.
# ---------------------------------------------------------------------------------------------
def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """q ``(B, Sq, H, d)``; k_cache and v_cache ``(B, capacity, Hk, d)``, or pages
    ``(num_blocks, page_size, Hk, d)`` with ``block_table`` ``(B, blocks per sequence)``; k and v
    (``(B, Snew, Hk, d)``) are written into the cache at ``cache_seqlens`` first. Returns out, or
    ``(out, softmax_lse)`` with ``return_softmax_lse``; JAX arrays, which are immutable, with k
    and v: that and the new caches, ``(result, k_cache, v_cache)``, as
    :func:`cupyflash.attention_with_kvcache`.

    Bad lengths and page ids raise ``RuntimeError`` in the call, naming the argument, as
    flash-attn's: a ``cache_seqlens`` entry below 0 or, with the ``Snew`` appended tokens, past the
    capacity (``k_cache.shape[1]``; paged, ``block_table.shape[1] * page_size``, and the message
    names ``block_table``), a page id that the call reads (the first ``ceil((cache_seqlens[b] +
    Snew) / page_size)`` of row ``b``) outside ``[0, num_blocks)``, a ``cache_batch_idx`` entry
    outside the cache's entries (or, with k and v, naming one entry twice), a ``cache_leftpad``
    entry outside ``[0, cache_seqlens[b]]``. Nothing is written into the cache then. On the GPU
    this reads the indices back (one synchronisation per call); under ``torch.compile``, JAX
    tracing and CUDA-graph capture no value can be read, and a bad one is reported as
    :func:`cupyflash.attention_with_kvcache` reports it: NaN rows and
    :func:`cupyflash.check_device_errors`."""
    if cache_seqlens is None:  # flash-attn: the whole cache
        if k is not None or v is not None:
            raise ValueError("flash_attn_with_kvcache: k and v are appended at cache_seqlens, which is None")
        cache_seqlens = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    _check_cache_values(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    result: Any = attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k, v_new=v,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, causal=causal, scale=softmax_scale,
        window=_window(causal, window_size), softcap=softcap, alibi_slopes=alibi_slopes, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, num_splits=num_splits, return_lse=True,
    )  # fmt: skip
    if k is not None and _interop.has_jax_arrays((q, k_cache, v_cache, k, v)):
        (out, lse), k_cache, v_cache = result
        return ((out, lse) if return_softmax_lse else out), k_cache, v_cache
    return result if return_softmax_lse else result[0]


# ---------------------------------------------------------------------------------------------
# The varlen forward: its device-side values checked in the call; paged (block_table) with inputs
# that require grad, the forward runs and its backward raises.
# ---------------------------------------------------------------------------------------------
def _varlen_forward(
    entry: str, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int, *,
    block_table: Any = None, **options: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """:func:`cupyflash.attention_varlen` (out, lse), its offsets, ``seqused_k`` and pages checked
    first (:func:`_check_varlen_values`). With a ``block_table`` and tensors that require grad
    (which the core call refuses up front), flash-attn's behaviour: the forward runs and a
    backward through it raises, naming the missing paged backward."""
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_values(entry, q, k, v, *args, seqused_k=options.get("seqused_k"), block_table=block_table)
    if block_table is not None and _library(q) == "torch":
        torch = sys.modules["torch"]
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):

            def run(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
                return attention_varlen(q, k, v, *args, block_table=block_table, return_lse=True, **options)

            result: tuple[Any, Any] = _paged_without_backward().apply(run, q, k, v)
            return result
    return attention_varlen(q, k, v, *args, block_table=block_table, return_lse=True, **options)


@functools.cache
def _paged_without_backward() -> Any:
    import torch

    class PagedVarlen(torch.autograd.Function):
        """The paged forward (run with grad mode off, as autograd runs a Function's forward), whose
        backward raises: an output that looks differentiable must never get a silent zero."""

        @staticmethod
        def forward(ctx: Any, run: Any, q: Any, k: Any, v: Any) -> Any:
            out, lse = run(q, k, v)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> Any:
            raise NotImplementedError(
                "flash_attn_varlen_func with a block_table has no backward (the paged varlen backward is not "
                "implemented, in flash-attn either): run the paged forward under torch.no_grad(), or pass "
                "contiguous k and v (without block_table) to differentiate it"
            )

    return PagedVarlen


# ---------------------------------------------------------------------------------------------
# flash-attn's contract for device-side lengths and page ids: a bad one raises in the call.
# ---------------------------------------------------------------------------------------------
def _index_values(q: Any, named: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """Host copies (int64) of a call's lengths and page ids, by name (those given), or None
    where no value can be read -- under ``torch.compile`` (a read would break the graph), JAX
    tracing (no values exist yet) and CUDA-graph capture (a copy to the host is not allowed
    there): the core API then reports a bad value as it does for its own callers (on the GPU the
    error word) -- and for arrays that are not integers (the core call refuses them, naming each).

    On the GPU this synchronises: the arrays go to the host in one copy, which waits for the
    work queued before it. One synchronisation per call is the price of flash-attn's contract,
    which its users accept; the core API never pays it (it checks on the device instead)."""
    given = {name: x for name, x in named.items() if x is not None}
    if _interop.compiling() or _interop.traced((q, *given.values())):
        return None
    if not given:
        return {}
    from array_api_compat import array_namespace

    found = _interop.gpu_arrays(("q", *given), (q, *given.values()))  # one library on one device, or ValueError
    arrays = list(given.values()) if found is None else found[2][1:]
    xp = array_namespace(*arrays)
    if not all(xp.isdtype(x.dtype, "integral") for x in arrays):
        return None
    if found is None:  # host arrays: read where they are, no synchronisation
        return {name: _host_ints(x) for name, x in zip(given, arrays)}
    lib, device, _ = found
    if _interop.stream_is_capturing(lib.stream(device)):
        return None
    flat = _host_ints(xp.concat([xp.reshape(xp.astype(x, xp.int64), (-1,)) for x in arrays]))  # the one copy
    values, start = {}, 0
    for name, x in zip(given, arrays):
        size = math.prod(x.shape)
        values[name] = flat[start : start + size].reshape(tuple(x.shape))
        start += size
    return values


def _host_ints(x: Any) -> np.ndarray:
    """An integer array of any library as int64 NumPy (a GPU array copied to the host)."""
    if _library(x) == "torch":
        x = x.detach().cpu().numpy()
    elif _library(x) == "cupy":
        x = x.get()
    return np.asarray(x).astype(np.int64)


def _raise_as_flash_attn(entry: str, check: Callable[[], Any]) -> Any:
    """Run a host-value check of the core API; its ValueError comes out as flash-attn raises a bad
    device-side value: ``RuntimeError``, naming the argument (the message says which)."""
    try:
        return check()
    except ValueError as error:
        raise RuntimeError(f"{entry}: {error}") from error


def _check_cache_values(
    q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, cache_batch_idx: Any, cache_leftpad: Any,
    block_table: Any,
) -> None:  # fmt: skip
    """flash-attn's contract for ``flash_attn_with_kvcache``: the lengths, page ids and cache
    entries the call uses, checked by the core API's host rule (``check_kvcache_values``: only
    the pages each sequence's length reaches count), raised as ``RuntimeError``. The shapes are
    checked first, as the core call checks them (``ValueError``)."""
    int_seqlens = type(cache_seqlens) is int
    named = {"cache_seqlens": None if int_seqlens else cache_seqlens, "block_table": block_table,
             "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad}  # fmt: skip
    values = _index_values(q, named)
    if values is None:
        return
    p = kvcache_problem_of(
        q, k_cache, v_cache, 0 if int_seqlens else cache_seqlens, block_table, k, v, Options(False, None),
        cache_batch_idx, cache_leftpad,
    )  # fmt: skip
    seqlens = [cache_seqlens] * p.attn.batch if int_seqlens else values["cache_seqlens"].tolist()
    pages, entries, first_keys = (
        None if n not in values else values[n].tolist() for n in ("block_table", "cache_batch_idx", "cache_leftpad")
    )
    _raise_as_flash_attn(
        "flash_attn_with_kvcache", lambda: check_kvcache_values(seqlens, pages, p, entries, first_keys)
    )


def _check_varlen_values(
    entry: str, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    seqused_k: Any = None, block_table: Any = None,
) -> None:  # fmt: skip
    """flash-attn's contract for the varlen functions: the offsets (starting at 0, never
    decreasing, within the packed rows and the max_seqlens), ``seqused_k`` (within each
    sequence's keys) and the pages (a key count within its table row, the page ids it reaches
    among the cache's), checked by the core API's host rules and raised as ``RuntimeError``."""
    named = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seqused_k": seqused_k,
             "block_table": block_table}  # fmt: skip
    values = _index_values(q, named)
    if values is None:
        return
    problem = _attention.varlen_problem_of(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, Options(False, None), seqused_k=seqused_k,
        block_table=block_table,
    )  # fmt: skip
    cu_q, cu_k = values["cu_seqlens_q"].tolist(), values["cu_seqlens_k"].tolist()
    used = None if seqused_k is None else values["seqused_k"].tolist()
    paged = block_table is not None

    def check() -> None:
        total_k = None if paged else k.shape[0]  # over pages the offsets are counts only
        check_cu_seqlens_values(cu_q, cu_k, q.shape[0], total_k, problem.seqlen_q, problem.seqlen_k)
        ends = check_seqused_values(cu_k, used)
        if paged:
            counts = [end - start for start, end in zip(cu_k, ends)]
            check_paged_keys(values["block_table"].tolist(), counts, k.shape[0], k.shape[1])

    _raise_as_flash_attn(entry, check)


# ---------------------------------------------------------------------------------------------
# S_dmask: flash-attn's dropout pattern, made on request on the host (N^2 memory).
# ---------------------------------------------------------------------------------------------
def _round128(n: int) -> int:
    return -(-n // 128) * 128


def _host(x: Any) -> Any:
    return None if x is None else to_numpy64(x)


def _like(q: Any, host: Any) -> Any:
    """A NumPy array as an array of q's library, device and dtype."""
    if _library(q) == "torch":
        return sys.modules["torch"].from_numpy(host).to(device=q.device, dtype=q.dtype)
    from array_api_compat import array_namespace, device

    xp = array_namespace(q)
    return xp.astype(xp.asarray(host, device=device(q)), q.dtype)


def _pattern(q: Any, k: Any, options: Options, dropout: xp_impl.Dropout, slopes: Any, block_n: int) -> Any:
    """One dense batch's pattern ``(B, Hq, Nq, Nk)``, float64, from host copies of q and k."""
    problem = _attention.problem_of(q, k, k, options, "bshd", dropout.p, slopes)
    return xp_impl.dropout_pattern(np, q, k, problem, dropout, block_n, slopes)


def _attn_probs(q: Any, k: Any, options: Options, dropout_p: float, seed: Any, alibi_slopes: Any) -> Any:
    """``S_dmask`` of a padded batch: ``(B, Hq, Sq, Sk)`` rounded up to multiples of 128 (as
    flash-attn's CUDA build), q's dtype; see :func:`cupyflash.xp_impl.dropout_pattern`."""
    b, sq, h, d = q.shape
    block_n = _get_block_size_n(getattr(q, "device", None), d, True, options.causal)
    pattern = _pattern(_host(q), _host(k), options, xp_impl.Dropout(dropout_p, seed), _host(alibi_slopes), block_n)
    padded = np.zeros((b, h, _round128(sq), _round128(k.shape[1])))
    padded[:, :, :sq, : k.shape[1]] = pattern
    return _like(q, padded)


def _varlen_attn_probs(
    q: Any, k: Any, cu_q: Any, cu_k: Any, max_seqlens: tuple[int, int], options: Options, dropout_p: float, seed: Any,
    alibi_slopes: Any,
) -> Any:  # fmt: skip
    """``S_dmask`` of packed sequences: ``(batch, Hq, max_seqlen_q, max_seqlen_k)`` rounded up to
    multiples of 128, sequence b's pattern at its top left (its own batch index in the mask)."""
    starts_q, starts_k = (to_numpy64(x).astype(int).tolist() for x in (cu_q, cu_k))
    host_q, host_k, slopes = _host(q), _host(k), _host(alibi_slopes)
    batch, (_, h, d) = len(starts_q) - 1, q.shape
    block_n = _get_block_size_n(getattr(q, "device", None), d, True, options.causal)
    padded = np.zeros((batch, h, _round128(max_seqlens[0]), _round128(max_seqlens[1])))
    for b in range(batch):
        q_b = host_q[None, starts_q[b] : starts_q[b + 1]]
        k_b = host_k[None, starts_k[b] : starts_k[b + 1]]
        slopes_b = slopes if slopes is None or slopes.ndim == 1 else slopes[b]
        dropout = xp_impl.Dropout(dropout_p, seed, batch0=b)
        padded[b, :, : q_b.shape[1], : k_b.shape[1]] = _pattern(q_b, k_b, options, dropout, slopes_b, block_n)[0]
    return _like(q, padded)


def _capability(device: Any) -> tuple[int, int]:
    """The compute capability of a CUDA device (a torch device or a CuPy device id); (8, 0) for
    the host, where the pattern's block size only has to agree with :func:`_get_block_size_n`."""
    if getattr(device, "type", None) == "cuda":
        major, minor = sys.modules["torch"].cuda.get_device_capability(device)
        return int(major), int(minor)
    device_id = getattr(device, "id", device)
    if type(device_id) is int:
        return divmod(int(_interop.cupy_module().cuda.Device(device_id).compute_capability), 10)
    return 8, 0


# flash_attn_interface's flag for its ROCm Triton backend, which callers and flash-attn's tests
# read to skip what only the CUDA extension does; cupyflash answers as the CUDA extension.
USE_TRITON_ROCM = False


def _get_block_size_n(device: Any, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """flash-attn's key-block size for ``S_dmask``: the block whose running max each element of
    the pattern is taken against (flash-attn's tests import it to decode the pattern). Here the
    pattern is made on the host, so this is the rule it is made by, flash-attn's table (it is not
    the key block of cupyflash's kernels)."""
    if head_dim > 256:
        raise ValueError(f"head_dim must be at most 256, got {head_dim}")
    major, minor = _capability(device)
    sm8x = major == 8 and minor > 0  # sm86 and sm89, not the A100's sm80
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        if sm8x:
            return 64 if (not is_dropout and is_causal) else 32
        return 32 if is_dropout else 64
    return 64


# ---------------------------------------------------------------------------------------------
# flash-attn 2.8's lower-level functions (flash_attn.flash_attn_interface's): what the libraries
# built on flash-attn call (ring-flash-attn, yunchang). Same kernels as the functions above.
# ---------------------------------------------------------------------------------------------
def _rng_state(q: Any, seed: int | None) -> Any:
    """flash-attn's ``rng_state``: int64 ``(2,)``, here ``[seed, 0]`` (the seed's 64 bits as a
    signed int64), on the host, so that the backward reads it without a device synchronisation;
    a tensor for tensors, else a NumPy array."""
    words = np.array([0 if seed is None else seed, 0], dtype=np.uint64).view(np.int64)
    return sys.modules["torch"].from_numpy(words) if _library(q) == "torch" else words


def _seed_of(rng_state: Any, dropout_p: Any) -> int | None:
    if not dropout_p:
        return None
    if rng_state is None:
        raise ValueError(
            "a backward with dropout_p > 0 needs the forward's rng_state (its dropout mask is regenerated from it)"
        )
    return int(rng_state[0]) % 2**64


def _write(given: Any, grad: Any) -> None:
    """flash-attn's backward writes the caller's dq, dk, dv: here a copy of the executor's fresh
    gradient into each (the kernels write their own outputs; one copy per gradient)."""
    if given is not None:
        given[...] = grad


def _softmax_d(dout: Any, out: Any, rows_axis: int, padded: tuple[int, ...]) -> Any:
    """flash-attn's ``softmax_d``, ``D = rowsum(dout * out)`` in float32, zero-padded as its CUDA
    build shapes it (``rows_axis``: the axis of ``dout`` that holds the heads)."""
    from array_api_compat import array_namespace, device

    xp = array_namespace(dout, out)
    d = xp.sum(xp.astype(dout, xp.float32) * xp.astype(out, xp.float32), axis=-1)  # (..., rows, heads)
    d = xp.moveaxis(d, rows_axis, -1)  # (..., heads, rows)
    result = xp.zeros(padded, dtype=xp.float32, device=device(dout))
    result[..., : d.shape[-1]] = d
    return result


def _flash_attn_forward(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Any,
    return_softmax: bool,
) -> tuple[Any, Any, Any, Any]:
    """flash-attn 2.8's ``_flash_attn_forward``: :func:`cupyflash.attention` on q ``(B, Sq, H, d)``,
    k and v ``(B, Sk, Hk, d)``. Returns ``(out, softmax_lse, S_dmask, rng_state)``: ``softmax_lse``
    float32 ``(B, H, Sq)``; ``S_dmask`` the dropout pattern with ``return_softmax`` and dropout
    (made on the host: O(Sq Sk) memory), else None; ``rng_state`` int64 ``(2,)`` on the host,
    ``[seed, 0]``, which :func:`_flash_attn_backward` takes to regenerate the dropout mask."""
    window, seed = _window(causal, (window_size_left, window_size_right)), _fresh_seed(q, dropout_p)
    out, lse = attention(
        q, k, v, causal=causal, scale=softmax_scale, window=window, softcap=softcap, return_lse=True,
        dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    s_dmask = None
    if return_softmax and dropout_p:
        s_dmask = _attn_probs(q, k, Options(causal, softmax_scale, window, softcap), dropout_p, seed, alibi_slopes)
    return out, lse, s_dmask, _rng_state(q, seed)


def _flash_attn_varlen_forward(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    return_softmax: bool = False,
    block_table: Any = None,
    leftpad_k: Any = None,
    seqused_k: Any = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
) -> tuple[Any, Any, Any, Any]:
    """flash-attn 2.8's ``_flash_attn_varlen_forward``: :func:`cupyflash.attention_varlen`.
    ``softmax_lse`` is ``(H, total_q)``; ``S_dmask``, ``rng_state`` as :func:`_flash_attn_forward`'s.
    ``zero_tensors`` changes nothing (rows outside every sequence are always 0, LSE -inf);
    ``num_splits`` neither (the kernel's split of the keys is chosen here). ``leftpad_k`` is not
    supported (NotImplementedError)."""
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k is not supported by attention_varlen: pass the keys without left padding")
    window, seed = _window(causal, (window_size_left, window_size_right)), _fresh_seed(q, dropout_p)
    out, lse = _varlen_forward(
        "_flash_attn_varlen_forward", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=softmax_scale, window=window, softcap=softcap, dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
        seqused_k=seqused_k, block_table=block_table,
    )  # fmt: skip
    s_dmask = None
    if return_softmax and dropout_p:
        options = Options(causal, softmax_scale, window, softcap)
        s_dmask = _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, (max_seqlen_q, max_seqlen_k), options,
                                     dropout_p, seed, alibi_slopes)  # fmt: skip
    return out, lse, s_dmask, _rng_state(q, seed)


def _flash_attn_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    softmax_lse: Any,
    dq: Any,
    dk: Any,
    dv: Any,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Any,
    deterministic: bool,
    rng_state: Any = None,
) -> Any:
    """flash-attn 2.8's ``_flash_attn_backward``: :func:`cupyflash.attention_backward`, its
    gradients written into the caller's ``dq``, ``dk``, ``dv`` (each may be None: computed and
    dropped, as flash-attn's). The executor returns fresh gradients, so each is copied into the
    given buffer once. Returns flash-attn's ``softmax_d``: float32 ``(B, H, round128(Sq))``,
    ``rowsum(dout * out)`` then zeros. With dropout, ``rng_state`` is the forward's (required)."""
    grads = attention_backward(
        dout, q, k, v, out, softmax_lse, causal=causal, scale=softmax_scale,
        window=_window(causal, (window_size_left, window_size_right)), softcap=softcap, deterministic=deterministic,
        dropout_p=dropout_p, seed=_seed_of(rng_state, dropout_p), alibi_slopes=alibi_slopes,
    )  # fmt: skip
    for given, grad in zip((dq, dk, dv), grads):
        _write(given, grad)
    b, sq, h, _ = q.shape
    return _softmax_d(dout, out, 1, (b, h, _round128(sq)))


def _flash_attn_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    softmax_lse: Any,
    dq: Any,
    dk: Any,
    dv: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Any,
    deterministic: bool,
    rng_state: Any = None,
    zero_tensors: bool = False,
) -> Any:
    """flash-attn 2.8's ``_flash_attn_varlen_backward``: :func:`cupyflash.attention_varlen_backward`
    into the caller's ``dq``, ``dk``, ``dv`` (one copy each, as :func:`_flash_attn_backward`).
    Returns ``softmax_d`` float32 ``(H, total_q + 128 batch)``: ``rowsum(dout * out)`` of the packed
    rows in order, then zeros (flash-attn spaces the sequences 128 rows apart in it; nothing reads
    it). The offsets are checked first, as the forward's (:func:`_check_varlen_values`)."""
    _check_varlen_values("_flash_attn_varlen_backward", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k)  # fmt: skip
    grads = attention_varlen_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=softmax_scale, window=_window(causal, (window_size_left, window_size_right)), softcap=softcap,
        deterministic=deterministic, dropout_p=dropout_p, seed=_seed_of(rng_state, dropout_p),
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    for given, grad in zip((dq, dk, dv), grads):
        _write(given, grad)
    total_q, h, _ = q.shape
    return _softmax_d(dout, out, 0, (h, total_q + 128 * (cu_seqlens_q.shape[0] - 1)))


class _FlashAttnGpu:
    """A stand-in for flash-attn's compiled module (``flash_attn_2_cuda``, imported as
    ``flash_attn_gpu``): its four entry points in their C++ argument order, on the functions
    above. ``out_`` (an output buffer) and the generator must be None; the backward entries
    return ``(dq, dk, dv, softmax_d)`` as flash-attn's do."""

    @staticmethod
    def fwd(q: Any, k: Any, v: Any, out_: Any, alibi_slopes: Any, p_dropout: float, softmax_scale: float,
            is_causal: bool, window_size_left: int, window_size_right: int, softcap: float, return_softmax: bool,
            gen_: Any = None) -> list[Any]:  # fmt: skip
        _refuse_buffers(out_, gen_)
        return list(_flash_attn_forward(q, k, v, p_dropout, softmax_scale, is_causal, window_size_left,
                                        window_size_right, softcap, alibi_slopes, return_softmax))  # fmt: skip

    @staticmethod
    def varlen_fwd(q: Any, k: Any, v: Any, out_: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any,
                   leftpad_k: Any, block_table: Any, alibi_slopes: Any, max_seqlen_q: int, max_seqlen_k: int,
                   p_dropout: float, softmax_scale: float, zero_tensors: bool, is_causal: bool, window_size_left: int,
                   window_size_right: int, softcap: float, return_softmax: bool, gen_: Any = None,
                   num_splits: int = 0) -> list[Any]:  # fmt: skip
        _refuse_buffers(out_, gen_)
        return list(_flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
            window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
            seqused_k, zero_tensors, num_splits,
        ))  # fmt: skip

    @staticmethod
    def bwd(dout: Any, q: Any, k: Any, v: Any, out: Any, softmax_lse: Any, dq_: Any, dk_: Any, dv_: Any,
            alibi_slopes: Any, p_dropout: float, softmax_scale: float, is_causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, deterministic: bool, gen_: Any = None,
            rng_state: Any = None) -> list[Any]:  # fmt: skip
        _refuse_buffers(None, gen_)
        dq, dk, dv = _buffers(dq_, dk_, dv_, q, k, v)
        softmax_d = _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale,
                                         is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                         deterministic, rng_state)  # fmt: skip
        return [dq, dk, dv, softmax_d]

    @staticmethod
    def varlen_bwd(dout: Any, q: Any, k: Any, v: Any, out: Any, softmax_lse: Any, dq_: Any, dk_: Any, dv_: Any,
                   cu_seqlens_q: Any, cu_seqlens_k: Any, alibi_slopes: Any, max_seqlen_q: int, max_seqlen_k: int,
                   p_dropout: float, softmax_scale: float, zero_tensors: bool, is_causal: bool, window_size_left: int,
                   window_size_right: int, softcap: float, deterministic: bool, gen_: Any = None,
                   rng_state: Any = None) -> list[Any]:  # fmt: skip
        _refuse_buffers(None, gen_)
        dq, dk, dv = _buffers(dq_, dk_, dv_, q, k, v)
        softmax_d = _flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
            deterministic, rng_state, zero_tensors,
        )  # fmt: skip
        return [dq, dk, dv, softmax_d]


def _refuse_buffers(out_: Any, gen_: Any) -> None:
    if out_ is not None or gen_ is not None:
        raise NotImplementedError("flash_attn_gpu's out_ and gen_ are not supported here: pass None")


def _buffers(dq: Any, dk: Any, dv: Any, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """The gradients' buffers: the caller's, or fresh ones like q, k, v (the C++ entry's rule)."""
    from array_api_compat import array_namespace

    xp = array_namespace(q)
    return tuple(xp.empty_like(x) if given is None else given for given, x in zip((dq, dk, dv), (q, k, v)))


#: flash-attn's compiled module, as ``flash_attn.flash_attn_interface`` names it.
flash_attn_gpu = _FlashAttnGpu()


# ---------------------------------------------------------------------------------------------
# Presenting this module as the flash_attn package, for libraries built on flash-attn.
# ---------------------------------------------------------------------------------------------
_ALIASES = ("flash_attn", "flash_attn.flash_attn_interface")


def install() -> None:
    """Register this module as ``flash_attn`` and ``flash_attn.flash_attn_interface`` in
    ``sys.modules``, so that libraries written against flash-attn (ring-flash-attn's context
    parallelism: ring, zigzag, stripe, llama3) import cupyflash's functions. Opt-in and
    explicit: call it before importing such a library. It refuses if another ``flash_attn`` is
    already imported (two implementations in one process); calling it twice is harmless.
    :func:`uninstall` removes the aliases.

    >>> import cupyflash.flash_attn
    >>> cupyflash.flash_attn.install()
    >>> from flash_attn.flash_attn_interface import _flash_attn_forward
    >>> _flash_attn_forward is cupyflash.flash_attn._flash_attn_forward
    True
    >>> cupyflash.flash_attn.uninstall()
    """
    this = sys.modules[__name__]
    for name in _ALIASES:
        present = sys.modules.get(name)
        if present is not None and present is not this:
            raise RuntimeError(
                f"{name} is already imported (from {getattr(present, '__file__', None)}): "
                "cupyflash.flash_attn.install() must run before anything imports flash-attn"
            )
    for name in _ALIASES:
        sys.modules[name] = this


def uninstall() -> None:
    """Remove the aliases :func:`install` registered (modules imported since keep what they took)."""
    for name in _ALIASES:
        if sys.modules.get(name) is sys.modules[__name__]:
            del sys.modules[name]
