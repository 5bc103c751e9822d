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

Differences that remain (each raises an error naming the argument, never a silent fallback):
``block_table`` on the varlen functions has no backward and no dropout; ``rotary_cos`` needs a row
for every position of the cache (flash-attn's own rule) and any even rotary dim is taken (flash-attn
asks for a multiple of 16).
``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: flash-attn's third value is the
dropout pattern its own tests read back, which is not materialised here (the mask is
``cupyflash.xp_impl.Dropout``'s, regenerated from the seed).
"""

from __future__ import annotations

from typing import Any

from . import _interop
from ._api import attention, attention_varlen, attention_with_kvcache
from ._validate import check_window

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _window(causal: bool, window_size: Any) -> tuple[int, int]:
    """flash-attn's rule: causal means a right bound of 0, whatever the window says. Bounds may
    be 0-d integer tensors or NumPy arrays (taken as the ints they hold)."""
    left, right = check_window(window_size)
    return (left, 0) if causal else (left, right)


def _returned(out_lse: tuple[Any, Any], return_attn_probs: bool) -> Any:
    out, lse = out_lse
    return (out, lse, None) if return_attn_probs else out


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
    result = attention(
        q, k, v, causal=causal, scale=softmax_scale, window=_window(causal, window_size), softcap=softcap,
        return_lse=True, deterministic=deterministic, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    return _returned(result, return_attn_probs)


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
    result = attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=softmax_scale,
        window=_window(causal, window_size), softcap=softcap, return_lse=True, deterministic=deterministic,
        dropout_p=dropout_p, alibi_slopes=alibi_slopes, block_table=block_table,
    )  # fmt: skip
    return _returned(result, return_attn_probs)


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
    :func:`cupyflash.attention_with_kvcache`."""
    if cache_seqlens is None:  # flash-attn: the whole cache
        if k is not None or v is not None:
            raise ValueError("flash_attn_with_kvcache: k and v are appended at cache_seqlens, which is None")
        cache_seqlens = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
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
