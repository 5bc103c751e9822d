"""PyTorch: ``attention`` and ``attention_varlen`` as ``torch.library`` custom ops with a fake
(meta) implementation and a registered backward, so that tensors that require grad get their
gradients (the FA2 backward) and ``torch.compile(fullgraph=True)`` keeps the call in its graph
as one opaque op; ``attention_with_kvcache`` as one too (no backward; the caches mutated).
``attention`` with a score_mod / mask_mod is the ``attention_mods`` op under torch.compile (the
traced expressions its text argument, the captured tensors graph inputs) and an autograd.Function
of its own in eager mode (``_ModsAttention``: the traced functions ride in the call), as is
``attention_varlen`` with them (eager only).
Imported when cupyflash first meets a torch tensor (``_interop.torch_module``) or at ``import
cupyflash`` when torch is already imported: importing cupyflash never imports torch.

The front door routes calls here (``_front.route``): always while Dynamo traces them
(``compiling``), and in eager mode when an input requires grad. Dynamo gets the custom ops; an
eager call gets the same op bodies through one ``torch.autograd.Function`` (``_Eager``), which
spares it the dispatcher's per-call work. The ops' bodies call the executors (``_attention``,
``_kvcache``) under ``torch.no_grad()``, which run the kernels (or the host path for CPU tensors)
as for any call. This module registers itself with the array protocol
(``_interop.compiling``) when it is imported; nothing below the front door imports it.
"""

from __future__ import annotations

import functools
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from . import _attention, _interop, _kvcache, _mods
from ._validate import Options, attention_problem, check_options

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
def _attention_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int,
    softcap: float, layout: str, algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor,
    alibi_slopes: Tensor | None, attn_mask: Tensor | None = None, batch_invariant: bool = False,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.Forward(
        q, k, v, options, layout, algorithm, deterministic, dropout_p, _seed_value(dropout_p, seed), alibi_slopes,
        attn_mask, batch_invariant=batch_invariant, sinks=sinks,
    )  # fmt: skip
    with torch.no_grad():
        out, lse = _attention.forward(call, want_lse=True)
    return _contiguous(out, lse)


attention_op = torch.library.custom_op(f"{_LIB}::attention", _attention_forward, mutates_args=())


@attention_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    layout: str, algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None,
    attn_mask: Tensor | None = None, batch_invariant: bool = False, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    p = _problem(q, k, v, causal, scale, window_left, window_right, softcap, layout)
    lse = q.new_empty((p.batch, p.heads_q, p.seqlen_q), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def _attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window_left: int, window_right: int, softcap: float, layout: str, deterministic: bool,
    dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None, attn_mask: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.Backward(
        dout, q, k, v, out, lse, dlse, options, layout, deterministic, dropout_p, _seed_value(dropout_p, seed),
        alibi_slopes, attn_mask, sinks=sinks,
    )  # fmt: skip
    with torch.no_grad():
        grads = _attention.backward(call)
    return _contiguous(*_four(q, grads))


def _four(q: Tensor, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A backward op's results: dq, dk, dv and dsinks (empty without sinks: an op's outputs are fixed)."""
    return grads if len(grads) == 4 else (*grads, q.new_empty((0,), dtype=torch.float32))


def _packed_outputs_like(
    q: Tensor, causal: bool, scale: float, window_left: int, window_right: int, softcap: float
) -> tuple[Tensor, Tensor]:
    """The packed forward ops' fake outputs, the options checked as the op checks them: O like q,
    LSE (Hq, total_q)."""
    check_options(causal, scale, (window_left, window_right), softcap)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def _dsinks_like(q: Tensor, sinks: Tensor | None) -> Tensor:
    """The fake dsinks: (Hq,) float32 with sinks (the kernels' dtype), else empty."""
    return q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32)


attention_backward_op = torch.library.custom_op(f"{_LIB}::attention_backward", _attention_backward, mutates_args=())


@attention_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window_left: int, window_right: int, softcap: float, layout: str, deterministic: bool,
    dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None, attn_mask: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return (*_empty_like(q, k, v), _dsinks_like(q, sinks))


def _setup_attention(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, causal, scale, window_left, window_right, softcap, layout, _, deterministic, dropout_p, seed = inputs[:13]
    mask, sinks = (inputs[i] if len(inputs) > i else None for i in (14, 16))  # (defaults: not given to the op)
    ctx.save_for_backward(q, k, v, *output, seed, inputs[13], mask, sinks)
    ctx.options = (causal, scale, window_left, window_right, softcap, layout, deterministic, dropout_p)


def _attention_grads(ctx: Any, dout: Tensor | None, dlse: Tensor | None, backward: Any = None) -> tuple[Any, ...]:
    """The gradients of the ``attention`` op's inputs, by the backward op (or by ``backward``, its
    body, on the eager route)."""
    q, k, v, out, lse, seed, alibi_slopes, attn_mask, sinks = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout  # the eager route: only lse was used
    dq, dk, dv, dsinks = (backward or attention_backward_op)(
        dout, q, k, v, out, lse, dlse, *ctx.options, seed, alibi_slopes, attn_mask, sinks
    )  # fmt: skip
    # the options, the seed, the slopes, the mask and batch_invariant get none; the sinks theirs
    return dq, dk, dv, *(None,) * 13, _sink_grad(dsinks, sinks)


def _sink_grad(dsinks: Tensor, sinks: Tensor | None) -> Tensor | None:
    return None if sinks is None else dsinks.to(sinks.dtype)


attention_op.register_autograd(_attention_grads, setup_context=_setup_attention)


def attention(call: _attention.Forward, want_lse: bool) -> tuple[Any, Any]:
    """An ``attention`` call through the custom op: (out, lse)."""
    if call.mods is not None:
        return _compiled_mods(call) if _interop.compiling() else _with_mods(call)
    _refuse_slope_grad(call.alibi_slopes)
    mask = call.attn_mask
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("attn_mask gets no gradient from cupyflash: pass a mask that does not require grad")
    o, q = call.options, call.q
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else float(o.scale)
    dropout_p = float(call.dropout_p)
    out, lse = _op_or_eager(attention_op, _ATTENTION)(
        q, call.k, call.v, bool(o.causal), scale, int(o.window[0]), int(o.window[1]), float(o.softcap), call.layout,
        call.algorithm, bool(call.deterministic), dropout_p, _seed_tensor(q, dropout_p, call.seed), call.alibi_slopes,
        mask, bool(call.batch_invariant), call.sinks,
    )  # fmt: skip
    return out, lse


class _ModsAttention(torch.autograd.Function):
    """``attention`` or ``attention_varlen`` with a score_mod / mask_mod under autograd (eager;
    the traced functions ride in the call, not in an op's schema): the backward is the matching
    backward with the same functions, dS times score_mod's derivative. score_mod's captured float
    tensors are inputs too (``captured``, slot order): those that require grad get dS times
    d score_mod / d (each element read), summed where it was read (a learned bias table's
    gradient)."""

    @staticmethod
    def forward(
        ctx: Any, call: _attention.Forward | _attention.VarlenForward, q: Tensor, k: Tensor, v: Tensor,
        sinks: Tensor | None, *captured: Tensor,
    ) -> tuple[Any, Any]:  # fmt: skip
        if isinstance(call, _attention.VarlenForward):
            out, lse = _contiguous(*_attention.varlen_forward(call, want_lse=True))
        else:
            out, lse = _contiguous(*_attention.forward(call, want_lse=True))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        c = ctx.call
        needs = ctx.needs_input_grad[5:]
        wanted = any(needs)
        dout = torch.zeros_like(out) if dout is None else dout
        with torch.no_grad():
            if isinstance(c, _attention.VarlenForward):
                grads = _attention.varlen_backward(_attention.VarlenBackward(
                    dout, q, k, v, out, lse, dlse, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                    c.options, c.deterministic, alibi_slopes=c.alibi_slopes, seqused_k=c.seqused_k, sinks=sinks,
                    mods=c.mods, captured_grads=wanted,
                ))  # fmt: skip
            else:
                grads = _attention.backward(_attention.Backward(
                    dout, q, k, v, out, lse, dlse, c.options, c.layout, c.deterministic, alibi_slopes=c.alibi_slopes,
                    mods=c.mods, sinks=sinks, block_mask=c.block_mask, captured_grads=wanted,
                ))  # fmt: skip
        dsinks = _sink_grad(grads[3], sinks) if sinks is not None else None
        dcaptured = [g if need else None for g, need in zip(grads[-1], needs)] if wanted else [None] * len(needs)
        return None, *grads[:3], dsinks, *dcaptured


def _with_mods(call: _attention.Forward) -> tuple[Any, Any]:
    call, captured = _detached_mods(call)
    out, lse = _ModsAttention.apply(call, call.q, call.k, call.v, call.sinks, *captured)
    return out, lse


def _detached_mods(call: Any) -> tuple[Any, tuple[Any, ...]]:
    """A call with a score_mod / mask_mod (``Forward`` or ``VarlenForward``) as its autograd.Function
    runs it: score_mod's captured tensors read detached (the Function's inputs instead, in slot
    order: returned beside the call); what gets no gradient from cupyflash refused by name."""
    score_mod, mask_mod = call.mods
    for x in () if mask_mod is None else mask_mod.buffers:
        if isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                "a mask_mod's captured tensor gets no gradient (a mask is piecewise constant in it): pass it detached"
            )
    captured = () if score_mod is None else score_mod.buffers
    if call.dropout_p:
        raise NotImplementedError("score_mod / mask_mod with dropout have no autograd yet")
    _refuse_slope_grad(call.alibi_slopes)
    if any(isinstance(x, Tensor) and x.requires_grad for x in captured):  # the call reads them detached
        detached = tuple(x.detach() if isinstance(x, Tensor) else x for x in captured)
        call = replace(call, mods=(replace(score_mod, buffers=detached), mask_mod))
    return call, captured


def _refuse_captured_grad(x: Any) -> None:
    if isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "under torch.compile a score_mod / mask_mod's captured tensor gets no gradient from cupyflash yet (in "
            "eager mode score_mod's do): pass it detached"
        )


# ---------------------------------------------------------------------------------------------
# attention with a score_mod / mask_mod under torch.compile: the traced pair is the ops' text
# argument (``_mods.encode``: the expressions, which name the kernel variant) and the captured
# tensors their Tensor[] argument, graph inputs, so that new values need no recompile.
# ---------------------------------------------------------------------------------------------
def _mods_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int,
    softcap: float, layout: str, algorithm: str, deterministic: bool, alibi_slopes: Tensor | None,
    sinks: Tensor | None, batch_invariant: bool, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.Forward(
        q, k, v, options, layout, algorithm, deterministic, alibi_slopes=alibi_slopes,
        mods=_mods.rebuilt(_mods.decode(mods), mod_arrays), batch_invariant=batch_invariant, sinks=sinks,
    )  # fmt: skip
    with torch.no_grad():
        out, lse = _attention.forward(call, want_lse=True)
    return _contiguous(out, lse)


attention_mods_op = torch.library.custom_op(f"{_LIB}::attention_mods", _mods_forward, mutates_args=())


@attention_mods_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int,
    softcap: float, layout: str, algorithm: str, deterministic: bool, alibi_slopes: Tensor | None,
    sinks: Tensor | None, batch_invariant: bool, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    p = _problem(q, k, v, causal, scale, window_left, window_right, softcap, layout)
    lse = q.new_empty((p.batch, p.heads_q, p.seqlen_q), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def _mods_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window_left: int, window_right: int, softcap: float, layout: str, deterministic: bool,
    alibi_slopes: Tensor | None, sinks: Tensor | None, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.Backward(
        dout, q, k, v, out, lse, dlse, options, layout, deterministic, alibi_slopes=alibi_slopes,
        mods=_mods.rebuilt(_mods.decode(mods), mod_arrays), sinks=sinks,
    )  # fmt: skip
    with torch.no_grad():
        grads = _attention.backward(call)
    return _contiguous(*_four(q, grads))


attention_mods_backward_op = torch.library.custom_op(
    f"{_LIB}::attention_mods_backward", _mods_backward, mutates_args=()
)


@attention_mods_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window_left: int, window_right: int, softcap: float, layout: str, deterministic: bool,
    alibi_slopes: Tensor | None, sinks: Tensor | None, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return (*_empty_like(q, k, v), _dsinks_like(q, sinks))


def _setup_mods(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, causal, scale, window_left, window_right, softcap, layout, _, deterministic = inputs[:11]
    alibi_slopes, sinks, _, mods, mod_arrays = inputs[11:]
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, sinks, *mod_arrays)
    ctx.options = (causal, scale, window_left, window_right, softcap, layout, deterministic)
    ctx.mods = mods


def _mods_grads(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
    """The gradients of the ``attention_mods`` op's inputs: q, k, v and the sinks' (the captured
    tensors get none: refused where they require grad)."""
    q, k, v, out, lse, alibi_slopes, sinks, *mod_arrays = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = attention_mods_backward_op(
        dout, q, k, v, out, lse, dlse, *ctx.options, alibi_slopes, sinks, ctx.mods, mod_arrays
    )
    # the options and the slopes get none; the sinks theirs; batch_invariant, the text, the arrays none
    return dq, dk, dv, *(None,) * 9, _sink_grad(dsinks, sinks), None, None, [None] * len(mod_arrays)


attention_mods_op.register_autograd(_mods_grads, setup_context=_setup_mods)


def _compiled_mods(call: _attention.Forward) -> tuple[Any, Any]:
    """An ``attention`` call with a score_mod / mask_mod while Dynamo traces it (``call.mods``:
    the functions as given), through the ``attention_mods`` op."""
    if call.dropout_p:
        raise NotImplementedError("score_mod / mask_mod with dropout do not run under torch.compile yet")
    _refuse_slope_grad(call.alibi_slopes)
    mods, mod_arrays = _traced_while_compiling(*call.mods)
    o, q = call.options, call.q
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else float(o.scale)
    out, lse = attention_mods_op(
        q, call.k, call.v, bool(o.causal), scale, int(o.window[0]), int(o.window[1]), float(o.softcap), call.layout,
        call.algorithm, bool(call.deterministic), call.alibi_slopes, call.sinks, bool(call.batch_invariant), mods,
        mod_arrays,
    )  # fmt: skip
    return out, lse


def _traced_while_compiling(score_mod: Any, mask_mod: Any) -> tuple[str, list[Tensor]]:
    """The pair traced while Dynamo traces the caller: the expressions' text (``_trace_once``,
    outside Dynamo's view) and the captured tensors, read here where Dynamo sees them, so that they
    enter the graph as inputs (not constants: a new doc_id of the same shape reruns the graph) and
    that Dynamo guards the numbers the functions capture (a new one recompiles). Numbers reached
    through other objects (``config.window``) are fixed at compile time."""
    functions = (score_mod, mask_mod)
    for role, fn in zip(("score_mod", "mask_mod"), functions):
        if _made_while_compiling(fn) and fn.__code__.co_freevars:
            raise NotImplementedError(
                f"under torch.compile, a {role} made inside the compiled code cannot capture its local variables "
                f"({', '.join(fn.__code__.co_freevars)}): Dynamo does not show cupyflash their values. Make it "
                "outside and pass it in, as an argument or a module attribute (e.g. mask_mod = make_mask(doc_id) "
                "before the compiled call); a function made inside may read module globals"
            )
    mods, arrays, numbers = _trace_once(score_mod, mask_mod)
    for which, where, value in numbers:
        if _read(functions[which], where) != value:  # equal: comparing makes Dynamo guard the number
            raise AssertionError(f"{where} changed while Dynamo traced")
    mod_arrays = []
    for which, where, shape in arrays:
        x = _read(functions[which], where)
        if not isinstance(x, Tensor):
            raise TypeError(
                f"under torch.compile, the arrays a {('score_mod', 'mask_mod')[which]} captures must be torch tensors, "
                f"got a {type(x).__name__}"
            )
        # equal: comparing makes Dynamo guard the shape (the text holds it). Size by size: Dynamo
        # 2.11 cannot guard a tuple comparison against _trace_once's constant result
        if x.dim() != len(shape) or any(size != want for size, want in zip(x.shape, shape)):
            raise AssertionError(f"{where} changed shape while Dynamo traced")
        _refuse_captured_grad(x)
        mod_arrays.append(x)
    return mods, mod_arrays


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _trace_once(score_mod: Any, mask_mod: Any) -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
    """The pair traced (``_mods``) once per compilation: Dynamo runs this on the functions
    themselves, outside its view, and keeps what it returns as constants: the expressions' text,
    where each captured array lives in its function ``(which, where, shape)``, and the Python
    numbers the functions read ``(which, where, value)`` (``_mods.reads``)."""
    score = None if score_mod is None else _mods.trace_score_mod(score_mod)
    mask = None if mask_mod is None else _mods.trace_mask_mod(mask_mod)
    arrays: list[tuple[int, Any, tuple[int, ...]]] = []
    numbers: list[tuple[int, Any, Any]] = []
    for which, (fn, mod) in enumerate(((score_mod, score), (mask_mod, mask))):
        if mod is None:
            continue
        reads = _mods.reads(fn)
        arrays += [(which, next(w for w, value in reads if value is x), tuple(x.shape)) for x in mod.buffers]
        numbers += [(which, w, value) for w, value in reads if type(value) in (bool, int, float)]
    return _mods.encode(_mods.static(score, mask)), tuple(arrays), tuple(numbers)


def _made_while_compiling(fn: Any) -> bool:
    """Whether Dynamo traced the making of ``fn`` (it shows no closure of such a function)."""
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        fn.__closure__  # noqa: B018 (the attribute read is the question)
    except AttributeError:
        return True
    return False


def _read(fn: Any, where: tuple[tuple[str, Any], ...]) -> Any:
    """What ``fn`` holds at ``where`` (``_mods.reads``' paths: the steps into each function it
    calls, then the place), read where Dynamo sees it."""
    for kind, at in where:
        if kind == "cell":
            fn = fn.__closure__[at].cell_contents
        elif kind == "default":
            fn = fn.__defaults__[at]
        elif kind == "item":  # a function in a tuple or list the caller holds (and_masks')
            fn = fn[at]
        else:
            try:
                namespace = fn.__globals__
            except AttributeError:  # a function made while Dynamo traced: its module's globals are its own
                fn = getattr(sys.modules[fn.__module__], at)
                continue
            fn = namespace[at]
    return fn


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
def _varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, batch_invariant: bool = False, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.VarlenForward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, algorithm, deterministic, dropout_p,
        _seed_value(dropout_p, seed), alibi_slopes, seqused_k, batch_invariant=batch_invariant, sinks=sinks,
    )  # fmt: skip
    with torch.no_grad():
        out, lse = _attention.varlen_forward(call, want_lse=True)
    return _contiguous(out, lse)


attention_varlen_op = torch.library.custom_op(f"{_LIB}::attention_varlen", _varlen_forward, mutates_args=())


@attention_varlen_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    algorithm: str, deterministic: bool, dropout_p: float, seed: Tensor, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, batch_invariant: bool = False, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _packed_outputs_like(q, causal, scale, window_left, window_right, softcap)


def _varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, window_right: int, softcap: float, deterministic: bool, dropout_p: float, seed: Tensor,
    alibi_slopes: Tensor | None, seqused_k: Tensor | None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.VarlenBackward(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, deterministic,
        dropout_p, _seed_value(dropout_p, seed), alibi_slopes, seqused_k, sinks,
    )  # fmt: skip
    with torch.no_grad():
        grads = _attention.varlen_backward(call)
    return _contiguous(*_four(q, grads))


attention_varlen_backward_op = torch.library.custom_op(
    f"{_LIB}::attention_varlen_backward", _varlen_backward, mutates_args=()
)


@attention_varlen_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, window_right: int, softcap: float, deterministic: bool, dropout_p: float, seed: Tensor,
    alibi_slopes: Tensor | None, seqused_k: Tensor | None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return (*_empty_like(q, k, v), _dsinks_like(q, sinks))


def _setup_varlen(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, _, deterministic = inputs[:14]
    dropout_p, seed, alibi_slopes, seqused_k = inputs[14:18]
    sinks = inputs[19] if len(inputs) > 19 else None
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, seed, alibi_slopes, seqused_k, sinks)
    ctx.options = (max_q, max_k, causal, scale, window_left, window_right, softcap, deterministic, dropout_p)


def _varlen_grads(ctx: Any, dout: Tensor | None, dlse: Tensor | None, backward: Any = None) -> tuple[Any, ...]:
    """The gradients of the ``attention_varlen`` op's inputs (``backward`` as in _attention_grads)."""
    q, k, v, out, lse, cu_q, cu_k, seed, alibi_slopes, seqused_k, sinks = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = (backward or attention_varlen_backward_op)(
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.options, seed, alibi_slopes, seqused_k, sinks
    )
    # the offsets, maxima, options, seed, slopes, seqused_k and batch_invariant get none; the sinks theirs
    return dq, dk, dv, *(None,) * 16, _sink_grad(dsinks, sinks)


attention_varlen_op.register_autograd(_varlen_grads, setup_context=_setup_varlen)


def attention_varlen(call: _attention.VarlenForward, want_lse: bool) -> tuple[Any, Any]:
    """An ``attention_varlen`` call through the custom op: (out, lse); with a score_mod / mask_mod,
    the ``attention_varlen_mods`` op under torch.compile, else ``_ModsAttention``."""
    if call.mods is not None:
        return _compiled_varlen_mods(call) if _interop.compiling() else _varlen_with_mods(call)
    _refuse_slope_grad(call.alibi_slopes)
    o, q = call.options, call.q
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else float(o.scale)
    dropout_p = float(call.dropout_p)
    out, lse = _op_or_eager(attention_varlen_op, _VARLEN)(
        q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, int(call.max_seqlen_q), int(call.max_seqlen_k),
        bool(o.causal), scale, int(o.window[0]), int(o.window[1]), float(o.softcap), call.algorithm,
        bool(call.deterministic), dropout_p, _seed_tensor(q, dropout_p, call.seed), call.alibi_slopes, call.seqused_k,
        bool(call.batch_invariant), call.sinks,
    )  # fmt: skip
    return out, lse


def _varlen_with_mods(call: _attention.VarlenForward) -> tuple[Any, Any]:
    call, captured = _detached_mods(call)
    return _ModsAttention.apply(call, call.q, call.k, call.v, call.sinks, *captured)


# attention_varlen with a score_mod / mask_mod under torch.compile, as attention_mods: the traced
# pair the ops' text argument, the captured tensors their Tensor[] argument.
def _varlen_mods_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    algorithm: str, deterministic: bool, alibi_slopes: Tensor | None, seqused_k: Tensor | None,
    sinks: Tensor | None, batch_invariant: bool, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.VarlenForward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, algorithm, deterministic,
        alibi_slopes=alibi_slopes, seqused_k=seqused_k, batch_invariant=batch_invariant, sinks=sinks,
        mods=_mods.rebuilt(_mods.decode(mods), mod_arrays),
    )  # fmt: skip
    with torch.no_grad():
        out, lse = _attention.varlen_forward(call, want_lse=True)
    return _contiguous(out, lse)


attention_varlen_mods_op = torch.library.custom_op(
    f"{_LIB}::attention_varlen_mods", _varlen_mods_forward, mutates_args=()
)


@attention_varlen_mods_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    algorithm: str, deterministic: bool, alibi_slopes: Tensor | None, seqused_k: Tensor | None,
    sinks: Tensor | None, batch_invariant: bool, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _packed_outputs_like(q, causal, scale, window_left, window_right, softcap)


def _varlen_mods_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, window_right: int, softcap: float, deterministic: bool, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, sinks: Tensor | None, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    call = _attention.VarlenBackward(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, deterministic,
        alibi_slopes=alibi_slopes, seqused_k=seqused_k, sinks=sinks, mods=_mods.rebuilt(_mods.decode(mods), mod_arrays),
    )  # fmt: skip
    with torch.no_grad():
        grads = _attention.varlen_backward(call)
    return _contiguous(*_four(q, grads))


attention_varlen_mods_backward_op = torch.library.custom_op(
    f"{_LIB}::attention_varlen_mods_backward", _varlen_mods_backward, mutates_args=()
)


@attention_varlen_mods_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, window_right: int, softcap: float, deterministic: bool, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, sinks: Tensor | None, mods: str, mod_arrays: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return (*_empty_like(q, k, v), _dsinks_like(q, sinks))


def _setup_varlen_mods(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, _, deterministic = inputs[:14]
    alibi_slopes, seqused_k, sinks, _, mods, mod_arrays = inputs[14:]
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, alibi_slopes, seqused_k, sinks, *mod_arrays)
    ctx.options = (max_q, max_k, causal, scale, window_left, window_right, softcap, deterministic)
    ctx.mods = mods


def _varlen_mods_grads(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
    """The gradients of the ``attention_varlen_mods`` op's inputs: q, k, v and the sinks' (the
    captured tensors get none: refused where they require grad)."""
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, seqused_k, sinks, *mod_arrays = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = attention_varlen_mods_backward_op(
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.options, alibi_slopes, seqused_k, sinks, ctx.mods, mod_arrays
    )
    # the offsets, maxima, options, slopes and seqused_k get none; the sinks theirs; the rest none
    return dq, dk, dv, *(None,) * 13, _sink_grad(dsinks, sinks), None, None, [None] * len(mod_arrays)


attention_varlen_mods_op.register_autograd(_varlen_mods_grads, setup_context=_setup_varlen_mods)


def _compiled_varlen_mods(call: _attention.VarlenForward) -> tuple[Any, Any]:
    """An ``attention_varlen`` call with a score_mod / mask_mod while Dynamo traces it (``call.mods``:
    the functions as given), through the ``attention_varlen_mods`` op (as ``_compiled_mods``)."""
    if call.dropout_p:
        raise NotImplementedError("score_mod / mask_mod with dropout do not run under torch.compile yet")
    _refuse_slope_grad(call.alibi_slopes)
    mods, mod_arrays = _traced_while_compiling(*call.mods)
    o, q = call.options, call.q
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else float(o.scale)
    out, lse = attention_varlen_mods_op(
        q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, int(call.max_seqlen_q), int(call.max_seqlen_k),
        bool(o.causal), scale, int(o.window[0]), int(o.window[1]), float(o.softcap), call.algorithm,
        bool(call.deterministic), call.alibi_slopes, call.seqused_k, call.sinks, bool(call.batch_invariant), mods,
        mod_arrays,
    )  # fmt: skip
    return out, lse


# ---------------------------------------------------------------------------------------------
# The eager route: an op's body, setup and backward called by one autograd.Function
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Twin:
    """What an op registers with autograd, for ``_Eager`` to call without the dispatcher."""

    forward: Callable[..., tuple[Tensor, Tensor]]  # the op's body
    setup: Callable[[Any, tuple[Any, ...], tuple[Tensor, Tensor]], None]  # its setup_context
    grads: Callable[..., tuple[Any, ...]]  # its backward, taking the backward op's body
    backward: Callable[..., tuple[Tensor, ...]]  # the backward op's body


class _Eager(torch.autograd.Function):
    """A custom op's forward and backward, called directly: the route of eager calls whose
    tensors require grad. Through the dispatcher an op pays per call for its schema's defaults,
    two redispatches and an aliasing check, before its own body runs; for the forward and
    backward of one training step that was more host time than cupyflash's own (cProfile on an
    H200, bf16 d = 64 N = 1k: a lone step's kernels waited ~0.42 ms for the host, cuDNN's
    ~0.06 ms; scripts/step_timeline.py). Same bodies, same saved tensors, same gradients; a
    gradient that only reaches lse is not made into zeros first (set_materialize_grads). Under
    torch.compile the custom op stays (``_op_or_eager``): Dynamo needs its fake kernel. The
    forward takes ``ctx`` itself (no ``setup_context``): with one, ``Function.apply`` binds the
    arguments through ``inspect.signature`` on every call (~30 us of a step's host time, cProfile)."""

    @staticmethod
    def forward(ctx: Any, twin: _Twin, *inputs: Any) -> tuple[Tensor, Tensor]:
        output = twin.forward(*inputs)
        twin.setup(ctx, inputs, output)
        ctx.twin = twin
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels have no backward of their own
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        return (None, *ctx.twin.grads(ctx, dout, dlse, ctx.twin.backward))


def _eager(name: str, twin: _Twin) -> Callable[..., tuple[Tensor, Tensor]]:
    """``twin`` through an ``_Eager`` of its own, so that outputs' ``grad_fn`` name the op
    (``cupyflash_attentionBackward``)."""
    function: Any = type(f"cupyflash_{name}", (_Eager,), {"__doc__": f"The eager route of the {name} op."})
    return functools.partial(function.apply, twin)


_ATTENTION = _eager("attention", _Twin(_attention_forward, _setup_attention, _attention_grads, _attention_backward))
_VARLEN = _eager("attention_varlen", _Twin(_varlen_forward, _setup_varlen, _varlen_grads, _varlen_backward))


def _op_or_eager(op: Any, eager: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
    """The custom op while Dynamo traces; otherwise its eager twin."""
    return op if _interop.compiling() else eager


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
    batch_invariant: bool = False, sinks: Tensor | None = None, tree_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    arrays = (q, k_cache, v_cache, cache_seqlen if cache_seqlens is None else cache_seqlens, block_table, k_new,
              v_new, cache_batch_idx, cache_leftpad, alibi_slopes, rotary_cos, rotary_sin, None, None,
              sinks, tree_mask)  # fmt: skip
    options = Options(causal, scale, (window_left, window_right), softcap)
    rotary = None if rotary_cos is None else rotary_interleaved
    call = _kvcache.cache_call(
        dict(zip(_kvcache.KV_NAMES, arrays)), options, num_splits, rotary, batch_invariant=batch_invariant
    )
    with torch.no_grad():
        out, lse = _kvcache.with_kvcache(call, want_lse=True)
    return _contiguous(out, lse)


@attention_with_kvcache_op.register_fake
def _(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_seqlen: int,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None, causal: bool, scale: float,
    num_splits: int, cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, rotary_interleaved: bool = True,
    batch_invariant: bool = False, sinks: Tensor | None = None, tree_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    b, nq, hq, _ = q.shape
    lse = q.new_empty((b, hq, nq), dtype=_lse_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def attention_with_kvcache(call: _kvcache.CacheCall, want_lse: bool) -> tuple[Any, Any]:
    """An ``attention_with_kvcache`` call through the custom op (while Dynamo traces it): (out, lse)."""
    if call.fp8:
        raise NotImplementedError(
            "attention_with_kvcache's k_scale / v_scale / kv_dtype do not go through torch.compile yet: call it "
            "outside the compiled region (a float8 cache with the default scales, 1.0, does)"
        )
    a, o = call.named, call.options
    q, seqlens = a["q"], a["cache_seqlens"]
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else float(o.scale)
    as_int = isinstance(seqlens, int)
    out, lse = attention_with_kvcache_op(
        q, a["k_cache"], a["v_cache"], None if as_int else seqlens, seqlens if as_int else 0, a["block_table"],
        a["k_new"], a["v_new"], o.causal, scale, int(call.num_splits), a["cache_batch_idx"], a["cache_leftpad"],
        o.window[0], o.window[1], o.softcap, a["alibi_slopes"], a["rotary_cos"], a["rotary_sin"],
        True if call.rotary is None else call.rotary, bool(call.batch_invariant), a["sinks"], a["tree_mask"],
    )  # fmt: skip
    return out, lse


def _problem(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
    layout: str,
) -> Any:  # fmt: skip
    options = check_options(causal, scale, (window_left, window_right), softcap)
    return attention_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), causal=options.causal, scale=options.scale,
        window=options.window, softcap=options.softcap, layout=layout,
    )  # fmt: skip


# Registered with the array protocol: the front door asks it whether Dynamo is tracing (a module
# attribute Dynamo can read while it traces).
_interop.compiling = torch.compiler.is_compiling
