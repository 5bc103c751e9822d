"""PyTorch: ``attention`` and ``attention_varlen`` as ``torch.library`` custom ops with a fake
(meta) implementation and a registered backward, so that tensors that require grad get their
gradients (the FA2 backward) and ``torch.compile(fullgraph=True)`` keeps the call in its graph
as one opaque op; ``attention_with_kvcache`` as one too (no backward; the caches mutated).
Imported when cupyflash first meets a torch tensor (``_interop.torch_module``) or at ``import
cupyflash`` when torch is already imported: importing cupyflash never imports torch.

The public functions route here (``_api``, ``_kvcache``): always while Dynamo traces them
(``compiling``), and in eager mode when an input requires grad. The ops' bodies call the public
functions again under ``torch.no_grad()``, which run the kernels (or the host path for CPU
tensors) as for any call.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor

from . import _api, _interop
from ._validate import attention_problem, check_options

_LIB = "cupyflash"


def _contiguous(*results: Tensor) -> Any:
    """The ops' results as their fake implementations state them: fresh contiguous tensors (the
    GPU's already are; the host path's can be permuted views)."""
    return tuple(x.contiguous() for x in results)


def _empty_like(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward ops' fake results: dq, dk, dv as fresh contiguous tensors."""
    fmt = torch.contiguous_format
    return (
        torch.empty_like(q, memory_format=fmt),
        torch.empty_like(k, memory_format=fmt),
        torch.empty_like(v, memory_format=fmt),
    )


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32  # xp_impl.compute_dtype


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::attention", mutates_args=())
def attention_op(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int,
    softcap: float, layout: str, algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor,
    alibi_slopes: Tensor | None, attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():
        out, lse = _api.attention(
            q, k, v, causal=causal, scale=scale, window=(window_left, window_right), softcap=softcap, layout=layout,
            algorithm=algorithm, return_lse=True, dropout_p=dropout_p, seed=_seed_value(dropout_p, seed),
            alibi_slopes=alibi_slopes, attn_mask=attn_mask,
        )  # fmt: skip
    return _contiguous(out, lse)


@attention_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    layout: str, algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None,
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    p = _problem(q, k, v, causal, scale, window_left, window_right, softcap, layout)
    lse = q.new_empty((p.batch, p.heads_q, p.seqlen_q), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op(f"{_LIB}::attention_backward", mutates_args=())
def attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window_left: int, window_right: int, softcap: float, layout: str, deterministic: bool,
    dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None, attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():
        grads = _api.attention_backward(
            dout, q, k, v, out, lse, dlse=dlse, causal=causal, scale=scale, window=(window_left, window_right),
            softcap=softcap, layout=layout, deterministic=deterministic, dropout_p=dropout_p,
            seed=_seed_value(dropout_p, seed), alibi_slopes=alibi_slopes, attn_mask=attn_mask,
        )  # fmt: skip
    return _contiguous(*grads)


@attention_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window_left: int, window_right: int, softcap: float, layout: str, deterministic: bool,
    dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None, attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _empty_like(q, k, v)


def _setup_attention(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, causal, scale, window_left, window_right, softcap, layout, _, deterministic, dropout_p, seed = inputs[:13]
    ctx.save_for_backward(q, k, v, *output, seed, inputs[13], inputs[14] if len(inputs) > 14 else None)
    ctx.options = (causal, scale, window_left, window_right, softcap, layout, deterministic, dropout_p)


def _attention_grads(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, seed, alibi_slopes, attn_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, lse, dlse, *ctx.options, seed, alibi_slopes, attn_mask)
    return dq, dk, dv, *(None,) * 12  # the options, the seed, the slopes and the mask get none


attention_op.register_autograd(_attention_grads, setup_context=_setup_attention)


def attention(q: Any, k: Any, v: Any, causal: Any, scale: Any, window: Any, softcap: Any, layout: str,
              algorithm: str, return_lse: bool, deterministic: bool, dropout_p: Any, seed: Any,
              alibi_slopes: Any = None, attn_mask: Any = None) -> Any:  # fmt: skip
    """``cupyflash.attention`` through the custom op (arguments as the public function's)."""
    _refuse_slope_grad(alibi_slopes)
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("attn_mask gets no gradient from cupyflash: pass a mask that does not require grad")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window_left, window_right = window
    dropout_p = float(dropout_p)
    out, lse = attention_op(
        q, k, v, bool(causal), scale, int(window_left), int(window_right), float(softcap), layout, algorithm,
        bool(deterministic), dropout_p, _seed_tensor(q, dropout_p, seed), alibi_slopes, attn_mask,
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Dropout's seed travels as a 0-d int64 CPU tensor: drawn by torch.randint when the caller
# gives none, it is an op in a compiled graph (a fresh seed per call, not a constant baked into
# the graph), and autograd saves it for the backward, which regenerates the mask from it.
# ---------------------------------------------------------------------------------------------
_U64 = 2**64


# The seed of a call without dropout: one constant (never read), not a tensor per call.
_NO_SEED = torch.zeros((), dtype=torch.int64)


def _seed_tensor(q: Tensor, dropout_p: float, seed: int | None) -> Tensor:
    if not dropout_p:
        return _NO_SEED
    if seed is None:
        if not torch.compiler.is_compiling() and q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise _interop.dropout_capture_error()
        return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    return torch.tensor(seed - _U64 if seed >= 2**63 else seed, dtype=torch.int64)  # int64's bits


def _refuse_slope_grad(slopes: Any) -> None:
    """The custom ops give ALiBi's slopes no gradient: slopes that require grad are refused (the
    eager path's check, written so that Dynamo traces it too)."""
    if slopes is not None and slopes.requires_grad and torch.is_grad_enabled():
        _interop.refuse_slope_grad(slopes)


def _seed_value(dropout_p: float, seed: Tensor) -> int | None:
    return int(seed) % _U64 if dropout_p else None


# ---------------------------------------------------------------------------------------------
# attention_varlen
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():
        out, lse = _api.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
            window=(window_left, window_right), softcap=softcap, algorithm=algorithm, return_lse=True,
            dropout_p=dropout_p, seed=_seed_value(dropout_p, seed), alibi_slopes=alibi_slopes, seqused_k=seqused_k,
        )  # fmt: skip
    return _contiguous(out, lse)


@attention_varlen_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    check_options(causal, scale, (window_left, window_right), softcap)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op(f"{_LIB}::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, window_right: int, softcap: float, deterministic: bool, dropout_p: float, seed: Tensor,
    alibi_slopes: Tensor | None, seqused_k: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():
        grads = _api.attention_varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse=dlse,
            causal=causal, scale=scale, window=(window_left, window_right), softcap=softcap,
            deterministic=deterministic, dropout_p=dropout_p, seed=_seed_value(dropout_p, seed),
            alibi_slopes=alibi_slopes, seqused_k=seqused_k,
        )  # fmt: skip
    return _contiguous(*grads)


@attention_varlen_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, window_right: int, softcap: float, deterministic: bool, dropout_p: float, seed: Tensor,
    alibi_slopes: Tensor | None, seqused_k: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _empty_like(q, k, v)


def _setup_varlen(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, _, deterministic = inputs[:14]
    dropout_p, seed, alibi_slopes, seqused_k = inputs[14:]
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, seed, alibi_slopes, seqused_k)
    ctx.options = (max_q, max_k, causal, scale, window_left, window_right, softcap, deterministic, dropout_p)


def _varlen_grads(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_q, cu_k, seed, alibi_slopes, seqused_k = ctx.saved_tensors
    dq, dk, dv = attention_varlen_backward_op(
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.options, seed, alibi_slopes, seqused_k
    )
    return dq, dk, dv, *(None,) * 15


attention_varlen_op.register_autograd(_varlen_grads, setup_context=_setup_varlen)


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                     max_seqlen_k: int, causal: Any, scale: Any, window: Any, softcap: Any, algorithm: str,
                     return_lse: bool, deterministic: bool, dropout_p: Any, seed: Any,
                     alibi_slopes: Any = None, seqused_k: Any = None) -> Any:  # fmt: skip
    """``cupyflash.attention_varlen`` through the custom op."""
    _refuse_slope_grad(alibi_slopes)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window_left, window_right = window
    dropout_p = float(dropout_p)
    out, lse = attention_varlen_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), scale,
        int(window_left), int(window_right), float(softcap), algorithm, bool(deterministic), dropout_p,
        _seed_tensor(q, dropout_p, seed), alibi_slopes, seqused_k,
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache: no backward (a cache is state, not a parameter); an op so that a
# compiled decode step keeps it in the graph, k_cache and v_cache declared as written in place.
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_seqlen: int,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None, causal: bool, scale: float,
    num_splits: int, cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, rotary_interleaved: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    from ._kvcache import attention_with_kvcache as kvcache

    with torch.no_grad():
        out, lse = kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlen if cache_seqlens is None else cache_seqlens,
            block_table=block_table, k_new=k_new, v_new=v_new, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, causal=causal, scale=scale, window=(window_left, window_right),
            softcap=softcap, alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, num_splits=num_splits, return_lse=True,
        )  # fmt: skip
    return _contiguous(out, lse)


@attention_with_kvcache_op.register_fake
def _(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_seqlen: int,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None, causal: bool, scale: float,
    num_splits: int, cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, rotary_interleaved: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    b, nq, hq, _ = q.shape
    lse = q.new_empty((b, hq, nq), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, k_new: Any,
                           v_new: Any, causal: Any, scale: Any, num_splits: Any, return_lse: bool,
                           cache_batch_idx: Any = None, cache_leftpad: Any = None, window: Any = (-1, -1),
                           softcap: Any = 0.0, alibi_slopes: Any = None, rotary_cos: Any = None,
                           rotary_sin: Any = None, rotary_interleaved: bool = True) -> Any:  # fmt: skip
    """``cupyflash.attention_with_kvcache`` through the custom op (while Dynamo traces it)."""
    causal, scale, window, softcap = check_options(causal, scale, window, softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    as_int = isinstance(cache_seqlens, int)
    out, lse = attention_with_kvcache_op(
        q, k_cache, v_cache, None if as_int else cache_seqlens, cache_seqlens if as_int else 0, block_table, k_new,
        v_new, causal, scale, int(num_splits), cache_batch_idx, cache_leftpad, window[0], window[1], softcap,
        alibi_slopes, rotary_cos, rotary_sin, bool(rotary_interleaved),
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _problem(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    layout: str,
) -> Any:  # fmt: skip
    options = check_options(causal, scale, (window_left, window_right), softcap)
    return attention_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), causal=options[0], scale=options[1], window=options[2],
        softcap=options[3], layout=layout,
    )  # fmt: skip


# The public functions find this module here (a module attribute Dynamo can read while it traces).
_interop.compiling = torch.compiler.is_compiling
_interop.torch_ops = sys.modules[__name__]
