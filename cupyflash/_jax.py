"""``cupyflash.attention`` and ``attention_with_kvcache`` inside JAX transformations (``jax.jit``,
``grad``, ``vmap``): one XLA custom call per direction, through
``jax.experimental.buffer_callback`` (no C++ build step).

A traced array has no memory, so the call is staged into the XLA program instead: at run time
XLA hands the callback its device buffers and its stream. On a GPU the callback views the
buffers as CuPy arrays (from their ``__cuda_array_interface__``, no copy), makes XLA's stream
CuPy's current one, and runs the executor every GPU call runs (``_attention.gpu_forward``: plan,
launch), the kernels writing straight into the output buffers XLA allocated. On the CPU backend
the buffers are NumPy arrays and the callback runs the host path (``xp_impl``, as an eager call
on CPU arrays does), whose fresh results are copied into XLA's buffers: one copy of out and
LSE, the host path's way, never a reference computation standing in for the kernels.

``jax.custom_vjp`` gives the call a backward: the forward saves q, k, v, out and the LSE; the
backward is a second custom call running ``attention_backward``'s pipeline. A score_mod /
mask_mod's traced expressions are part of the static key (``Config.mods``) and their captured
arrays are operands of both calls (a new doc_id: the same program). Dropout's seed is an
operand of both calls (a ``(2,)`` uint32 array: low and high words), as the PyTorch ops carry it
in a tensor, so forward and backward draw one mask; JAX has no global generator, so under a
transformation the caller gives the seed (an int, or a JAX integer array such as one drawn from
``jax.random.bits``).

The cache call (inference only, as flash-attn's: a ``jax.custom_jvp`` refuses differentiation)
has every array argument as an operand. JAX arrays are immutable, so with k_new it returns the
appended caches too: the custom call's cache results alias the cache operands
(``input_output_aliases``), and the kernels append into the result buffers, which XLA makes the
operands' own when the caller donates them (else it copies the caches there first). Concrete JAX
arrays with k_new run the same call, compiled once per static key. Imported on the first call
that needs it (``_front.jax_ops``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.buffer_callback import buffer_callback

from . import _attention, _host, _interop, _kvcache, _mods
from ._validate import Options, check_dropout, check_num_splits

#: How many times XLA has run each callback, by (platform, direction): ("gpu", "forward"),
#: ("cpu", "backward") ... The GPU tests read it as proof that the kernels ran in the program.
runs: collections.Counter[tuple[str, str]] = collections.Counter()

_U32 = 2**32

# jax.vmap runs the custom call once per mapped element, in a loop of the XLA program: the
# kernels take one (B, N, H, d) problem, and folding the mapped axis into the batch would need
# the arrays' layouts rewritten at every call.
_VMAP_METHOD = "sequential"


@dataclasses.dataclass(frozen=True)
class Config:
    """A call's static options (checked), the key of its callbacks."""

    options: Options
    layout: str
    algorithm: str
    return_lse: bool
    deterministic: bool
    dropout_p: float
    problem: Any  # the validated Problem (shapes, mask): the backward's plan key
    batch_invariant: bool = False
    mods: Any = None  # score_mod / mask_mod without their arrays (_mods.Static; the arrays are operands)


def attention(call: _attention.Forward, want_lse: bool) -> tuple[Any, Any]:
    """An ``attention`` call with traced inputs (options checked by the entry): (out, lse), lse
    None unless wanted."""
    q, k, v, alibi_slopes, sinks = call.q, call.k, call.v, call.alibi_slopes, call.sinks
    if call.attn_mask is not None:
        raise NotImplementedError("attention with attn_mask does not run under a JAX transformation yet")
    dropout_p, _ = check_dropout(call.dropout_p, None)
    _check_jax_arrays("attention", {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks})
    mods: Any = None
    mod_arrays: tuple[Any, ...] = ()
    if call.mods is not None:  # the expressions are static (the callbacks' key), their arrays operands
        mods, mod_arrays = _mods.static(*call.mods), _mods.captured(*call.mods)
        named: dict[str, Any] = {f"a score_mod / mask_mod's captured array {i}": x for i, x in enumerate(mod_arrays)}
        _check_jax_arrays("attention", named)
    problem = _attention.problem_of(q, k, v, call.options, call.layout, dropout_p, alibi_slopes, sinks)
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if alibi_slopes is not None and alibi_slopes.dtype != jnp.float32:
        raise TypeError(f"alibi_slopes must be float32 (as flash-attn's), got {alibi_slopes.dtype}")
    if sinks is not None and sinks.dtype != jnp.float32:
        raise TypeError(f"sinks must be float32 (sinks.astype(jnp.float32) keeps its gradient), got {sinks.dtype}")
    config = Config(
        call.options, call.layout, call.algorithm, bool(want_lse), bool(call.deterministic), dropout_p, problem,
        bool(call.batch_invariant), mods,
    )  # fmt: skip
    result = _attention_vjp(config, q, k, v, _seed_operand(dropout_p, call.seed), alibi_slopes, sinks, mod_arrays)
    return result if want_lse else (result, None)


def _check_jax_arrays(entry: str, named: dict[str, Any], where: str = "inside a JAX transformation") -> None:
    for name, x in named.items():
        if x is not None and not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a JAX array when cupyflash.{entry} runs {where}, got {type(x).__name__}")


def _seed_operand(dropout_p: float, seed: Any) -> Any:
    """Dropout's seed as the custom calls' ``(2,)`` uint32 operand (low word, high word), or None
    without dropout."""
    if not dropout_p:
        return None
    if seed is None:
        raise ValueError(
            "dropout inside a JAX transformation needs seed=: JAX has no global random state, and a seed drawn while "
            "tracing would repeat in every call of the compiled function. Pass an int, or a JAX integer array (e.g. "
            "jax.random.bits(key, dtype=jnp.uint32)); give a fresh one per step for fresh masks"
        )
    if isinstance(seed, jax.Array) or hasattr(seed, "dtype"):
        x = jnp.asarray(seed)
        if x.shape == (2,) and x.dtype == jnp.uint32:
            return x
        if x.shape == () and jnp.issubdtype(x.dtype, jnp.integer):  # its bits, as an unsigned integer
            high = (x >> 32).astype(jnp.uint32) if x.dtype.itemsize == 8 else jnp.zeros((), jnp.uint32)
            return jnp.stack([x.astype(jnp.uint32), high])
        raise ValueError(
            f"seed must be an int, a 0-d JAX integer array or a (2,) uint32 array, got {x.dtype} {x.shape}"
        )
    _, value = check_dropout(dropout_p, seed)
    assert value is not None
    return np.array([value % _U32, value // _U32], dtype=np.uint32)


def _seed_value(words: np.ndarray) -> int:
    return int(words[0]) + _U32 * int(words[1])


# ---------------------------------------------------------------------------------------------
# The differentiable function: primal, forward with residuals, backward.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_vjp(
    config: Config, q: Any, k: Any, v: Any, seed: Any, slopes: Any, sinks: Any, mod_arrays: tuple[Any, ...]
) -> Any:
    out, lse = _forward(config, q, k, v, seed, slopes, sinks, mod_arrays, config.return_lse)
    return (out, lse) if config.return_lse else out


def _attention_fwd(
    config: Config, q: Any, k: Any, v: Any, seed: Any, slopes: Any, sinks: Any, mod_arrays: tuple[Any, ...]
) -> tuple[Any, Any]:
    # symbolic_zeros: each primal comes as (value, perturbed), so differentiated slopes are seen
    if slopes is not None and slopes.perturbed:
        raise RuntimeError(
            "alibi_slopes are differentiated, but ALiBi's slopes get no gradient (as in flash-attn): pass "
            "jax.lax.stop_gradient(slopes)"
        )
    score_arrays = _score_mod_arrays(config)
    if any(x.perturbed for x in mod_arrays[score_arrays:]):
        raise NotImplementedError(
            "a mask_mod's captured array is differentiated, but it gets no gradient (a mask is piecewise constant in "
            "it): pass jax.lax.stop_gradient(x)"
        )
    # score_mod's differentiated arrays: the backward computes their gradients (a marker in the
    # residuals, which carry arrays or None, not Python flags)
    captured = jnp.zeros((0,)) if any(x.perturbed for x in mod_arrays[:score_arrays]) else None
    q, k, v = q.value, k.value, v.value
    seed = None if seed is None else seed.value
    slopes = None if slopes is None else slopes.value
    sinks = None if sinks is None else sinks.value
    mod_arrays = tuple(x.value for x in mod_arrays)
    out, lse = _forward(config, q, k, v, seed, slopes, sinks, mod_arrays, True)
    return ((out, lse) if config.return_lse else out), (q, k, v, out, lse, seed, slopes, sinks, mod_arrays, captured)


def _attention_bwd(config: Config, residuals: Any, cotangent: Any) -> tuple[Any, ...]:
    q, k, v, out, lse, seed, slopes, sinks, mod_arrays, captured = residuals
    dout, dlse = cotangent if config.return_lse else (cotangent, None)
    if isinstance(dlse, SymbolicZero):  # the loss does not use the LSE
        dlse = None
    if isinstance(dout, SymbolicZero):  # a loss of the LSE alone
        dout = jnp.zeros(out.shape, out.dtype)
    grads = _backward(config, dout, q, k, v, out, lse, dlse, seed, slopes, sinks, mod_arrays, captured is not None)
    dsinks = grads[3] if sinks is not None else None
    # the seed and the slopes get none; score_mod's float arrays theirs where asked, the rest none
    found = iter(grads[3 + (sinks is not None) :])
    dcaptured = tuple(next(found) if slot in _float_slots(config, mod_arrays) and captured is not None else None
                      for slot in range(len(mod_arrays)))  # fmt: skip
    return *grads[:3], None, None, dsinks, dcaptured


def _score_mod_arrays(config: Config) -> int:
    """How many of the captured arrays (``_mods.captured``'s order) are score_mod's."""
    return 0 if config.mods is None or config.mods[0] is None else config.mods[0][1]


def _float_slots(config: Config, mod_arrays: tuple[Any, ...]) -> list[int]:
    """score_mod's captured float arrays (those with a gradient), by position."""
    return [i for i, x in enumerate(mod_arrays[: _score_mod_arrays(config)]) if jnp.issubdtype(x.dtype, jnp.floating)]


_attention_vjp.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _lse_struct(problem: Any, q: Any) -> Any:
    """The LSE of an attention problem over q: float32 (float64 for float64 host inputs)."""
    dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32  # xp_impl.compute_dtype
    return jax.ShapeDtypeStruct((problem.batch, problem.heads_q, problem.seqlen_q), dtype)


def _forward(
    config: Config, q: Any, k: Any, v: Any, seed: Any, slopes: Any, sinks: Any, mod_arrays: tuple[Any, ...],
    want_lse: bool,
) -> tuple[Any, Any]:  # fmt: skip
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if want_lse:
        results.append(_lse_struct(config.problem, q))
    callback = _forward_callback(config, seed is not None, slopes is not None, sinks is not None, want_lse)
    extras = (*(x for x in (seed, slopes, sinks) if x is not None), *mod_arrays)
    outputs = buffer_callback(callback, tuple(results), vmap_method=_VMAP_METHOD)(q, k, v, *extras)
    return outputs[0], (outputs[1] if want_lse else None)


def _backward(
    config: Config, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any, seed: Any, slopes: Any,
    sinks: Any, mod_arrays: tuple[Any, ...], captured: bool = False,
) -> tuple[Any, ...]:  # fmt: skip
    """(dq, dk, dv), and dsinks (in the sinks' float32) with sinks, and with ``captured`` the
    gradients of score_mod's captured float arrays (``_float_slots``' order)."""
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    if sinks is not None:
        results += (jax.ShapeDtypeStruct(sinks.shape, sinks.dtype),)
    if captured:
        results += tuple(jax.ShapeDtypeStruct(mod_arrays[i].shape, mod_arrays[i].dtype)
                         for i in _float_slots(config, mod_arrays))  # fmt: skip
    callback = _backward_callback(
        config, dlse is not None, seed is not None, slopes is not None, sinks is not None, captured
    )
    extras = (*(x for x in (dlse, seed, slopes, sinks) if x is not None), *mod_arrays)
    return tuple(buffer_callback(callback, results, vmap_method=_VMAP_METHOD)(dout, q, k, v, out, lse, *extras))


# ---------------------------------------------------------------------------------------------
# The callbacks XLA runs. One function object per static key (functools.cache): the primitive
# carries it as a parameter, so a stable object lets JAX reuse what it compiled for it.
# ---------------------------------------------------------------------------------------------
def _split(extras: tuple[Any, ...], *present: bool) -> list[Any]:
    """The optional operands, None where absent, from the ones passed, then a tuple of the rest
    (the captured arrays of a score_mod / mask_mod)."""
    it = iter(extras)
    return [*(next(it) if here else None for here in present), tuple(it)]


def _mods_on(config: Config, arrays: tuple[Any, ...], view: Any) -> Any:
    """The call's score_mod / mask_mod on its captured arrays' buffers (as ``view`` makes them), or None."""
    return None if config.mods is None else _mods.rebuilt(config.mods, (view(x) for x in arrays))


@functools.cache
def _forward_callback(config: Config, has_seed: bool, has_slopes: bool, has_sinks: bool, want_lse: bool) -> Any:
    def callback(ctx: Any, results: Any, q: Any, k: Any, v: Any, *extras: Any) -> None:
        seed, slopes, sinks, mod_arrays = _split(extras, has_seed, has_slopes, has_sinks)
        stream = _xla_stream(ctx)
        if stream is None:
            _host_forward(config, results, q, k, v, seed, slopes, sinks, mod_arrays)
            runs["cpu", "forward"] += 1
            return
        cupy = _interop.cupy_module()
        q, k, v = _cupy_view(q), _cupy_view(k), _cupy_view(v)
        device = q.data.device_id
        with cupy.cuda.Device(device), _cupy_stream(stream, device):
            given = {"out": _cupy_view(results[0])}
            if want_lse:
                given["lse"] = _cupy_view(results[1])
            call = _attention.Forward(
                q, k, v, config.options, config.layout, config.algorithm, config.deterministic, config.dropout_p,
                _gpu_seed(seed), None if slopes is None else _cupy_view(slopes),
                mods=_mods_on(config, mod_arrays, _cupy_view), batch_invariant=config.batch_invariant,
                sinks=None if sinks is None else _cupy_view(sinks),
            )  # fmt: skip
            _attention.gpu_forward(_interop.CUPY_LIB, device, call, want_lse, given)
        runs["gpu", "forward"] += 1

    return callback


@functools.cache
def _backward_callback(
    config: Config, has_dlse: bool, has_seed: bool, has_slopes: bool, has_sinks: bool, captured: bool = False
) -> Any:
    def callback(ctx: Any, results: Any, *operands: Any) -> None:
        dout, q, k, v, out, lse = operands[:6]
        dlse, seed, slopes, sinks, mod_arrays = _split(operands[6:], has_dlse, has_seed, has_slopes, has_sinks)
        stream = _xla_stream(ctx)
        if stream is None:
            _host_backward(config, results, dout, q, k, v, out, lse, dlse, seed, slopes, sinks, mod_arrays, captured)
            runs["cpu", "backward"] += 1
            return
        if captured:  # the array-API backward on CuPy views (the kernels have no scatter for it)
            _captured_gpu_backward(config, stream, results, dout, q, k, v, out, lse, dlse, seed, slopes, sinks,
                                   mod_arrays)  # fmt: skip
            runs["gpu", "backward"] += 1
            return
        cupy = _interop.cupy_module()
        dout, q, k, v, out, lse = (_cupy_view(x) for x in (dout, q, k, v, out, lse))
        dlse, slopes, sinks = (None if x is None else _cupy_view(x) for x in (dlse, slopes, sinks))
        device = q.data.device_id
        with cupy.cuda.Device(device), _cupy_stream(stream, device):
            given = {name: _cupy_view(x) for name, x in zip(("dq", "dk", "dv"), results)}
            call = _attention.Backward(
                dout, q, k, v, out, lse, dlse, config.options, config.layout, config.deterministic, config.dropout_p,
                _gpu_seed(seed), slopes, mods=_mods_on(config, mod_arrays, _cupy_view), sinks=sinks,
            )  # fmt: skip
            grads = _attention.gpu_backward(_interop.CUPY_LIB, device, call, config.problem, given)
            if sinks is not None:  # summed per head on the stream, into XLA's result
                _cupy_view(results[3])[...] = grads[3]
        runs["gpu", "backward"] += 1

    return callback


def _captured_gpu_backward(
    config: Config, stream: int, results: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any,
    seed: Any, slopes: Any, sinks: Any, mod_arrays: Any,
) -> None:  # fmt: skip
    """A backward that also gives score_mod's captured arrays their gradients, on the GPU: the
    array-API algorithm on CuPy views of XLA's buffers, on XLA's stream, into its results."""
    cupy = _interop.cupy_module()

    def view(x: Any) -> Any:
        """A CuPy view, bfloat16 widened to float32 (exact): NumPy's isdtype, which CuPy's array
        API uses, does not take ml_dtypes' bfloat16, and the algorithm computes in float32 anyway."""
        x = _cupy_view(x)
        return x.astype(cupy.float32) if x.dtype.name == "bfloat16" else x

    device = _cupy_view(q).data.device_id
    with cupy.cuda.Device(device), _cupy_stream(stream, device):
        dout, q, k, v, out, lse = (view(x) for x in (dout, q, k, v, out, lse))
        dlse, slopes, sinks = (None if x is None else view(x) for x in (dlse, slopes, sinks))
        call = _attention.Backward(
            dout, q, k, v, out, lse, dlse, config.options, config.layout, config.deterministic, config.dropout_p,
            _gpu_seed(seed), slopes, mods=_mods_on(config, mod_arrays, view), sinks=sinks, captured_grads=True,
        )  # fmt: skip
        grads = _attention.backward(call)
        wanted = [*grads[:-1], *(g for g in grads[-1] if g is not None)]
        for buffer, grad in zip(results, wanted, strict=True):
            _cupy_view(buffer)[...] = grad  # (rounded to the result's dtype)


# ---------------------------------------------------------------------------------------------
# The cache call: attention_with_kvcache. Inference only, as flash-attn's: no backward.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KvConfig:
    """A cache call's static options (checked) and which operands it has, its callback's key."""

    options: Options
    num_splits: int
    rotary: bool | None  # rotary_interleaved with rotary tables, else None
    return_lse: bool
    names: tuple[str, ...]  # the operands given, in _kvcache.KV_NAMES' order
    problem: Any  # the validated KvCacheProblem
    batch_invariant: bool = False

    @property
    def appends(self) -> bool:
        return "k_new" in self.names


def attention_with_kvcache(call: _kvcache.CacheCall, want_lse: bool) -> tuple[Any, ...]:
    """``cupyflash.attention_with_kvcache`` on JAX arrays (traced, or concrete ones with k_new;
    options already checked by the entry): one custom call. (out, lse), lse None unless wanted;
    with k_new (out, lse, k_cache, v_cache), the caches with the new tokens as new arrays (the
    custom call's results alias the cache operands: XLA writes in place into donated caches and
    copies the others first)."""
    arrays = call.named
    if call.fp8 or "float8" in str(arrays["k_cache"].dtype):
        raise NotImplementedError("attention_with_kvcache with a float8 cache does not run on JAX arrays yet")
    if arrays["tree_mask"] is not None:
        raise NotImplementedError("attention_with_kvcache with a tree_mask does not run on JAX arrays yet")
    options, num_splits, rotary = call.options, check_num_splits(call.num_splits), call.rotary
    seqlens = arrays["cache_seqlens"]
    others = {n: x for n, x in arrays.items() if not (n == "cache_seqlens" and type(x) is int)}
    _check_jax_arrays("attention_with_kvcache", others, "on JAX arrays (inside a JAX transformation, or appending)")
    problem = _kvcache.kvcache_problem_of(
        arrays["q"], arrays["k_cache"], arrays["v_cache"], seqlens, arrays["block_table"], arrays["k_new"],
        arrays["v_new"], options, arrays["cache_batch_idx"], arrays["cache_leftpad"], arrays["alibi_slopes"],
        (arrays["rotary_cos"], arrays["rotary_sin"], rotary), arrays["sinks"],
    )  # fmt: skip
    operands = {n: x for n, x in others.items() if x is not None}
    _host.check_kvcache_dtypes(jnp, operands)
    if type(seqlens) is int:  # checked against the capacity above; an operand, so no recompile per length
        operands["cache_seqlens"] = np.full((problem.attn.batch,), seqlens, np.int32)
    names = tuple(n for n in _kvcache.KV_NAMES if n in operands)
    config = KvConfig(options, num_splits, rotary, bool(want_lse), names, problem, bool(call.batch_invariant))
    values = tuple(operands[n] for n in names)
    # Concrete arrays: the same custom call, compiled once per config; the caller's caches stay
    # as they were (XLA copies them into the results, which it does not when a jitted caller
    # donates them).
    result = _kvcache_call(config, values) if _interop.traced(values) else _compiled_kvcache_call(config)(values)
    if not config.appends:
        return result if want_lse else (result, None)
    result, k_cache, v_cache = result
    out, lse = result if want_lse else (result, None)
    return out, lse, k_cache, v_cache


@functools.cache
def _compiled_kvcache_call(config: KvConfig) -> Any:
    return jax.jit(functools.partial(_kvcache_call, config))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _kvcache_call(config: KvConfig, operands: tuple[Any, ...]) -> Any:
    q = operands[0]
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if config.return_lse:
        results.append(_lse_struct(config.problem.attn, q))
    aliases = {}
    if config.appends:  # operands 1 and 2 are k_cache and v_cache: the last two results
        aliases = {1: len(results), 2: len(results) + 1}
        results += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands[1:3]]
    outputs = buffer_callback(
        _kvcache_callback(config), tuple(results), vmap_method=_VMAP_METHOD, input_output_aliases=aliases
    )(*operands)
    result = (outputs[0], outputs[1]) if config.return_lse else outputs[0]
    return (result, outputs[-2], outputs[-1]) if config.appends else result


def _kvcache_jvp(config: KvConfig, primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    (operands,), (dots,) = primals, tangents
    moved = [n for n, t in zip(config.names, dots) if not isinstance(t, SymbolicZero)]
    if moved:
        which = f"{', '.join(moved)} {'is' if len(moved) == 1 else 'are'}"
        raise TypeError(
            "attention_with_kvcache has no derivative (it is inference only, as flash-attn's "
            f"flash_attn_with_kvcache), but {which} differentiated here: compute the gradient with "
            "cupyflash.attention, or pass jax.lax.stop_gradient(x) where no gradient is wanted"
        )
    out = _kvcache_call(config, operands)
    return out, jax.tree.map(jnp.zeros_like, out)


_kvcache_call.defjvp(_kvcache_jvp, symbolic_zeros=True)


@functools.cache
def _kvcache_callback(config: KvConfig) -> Any:
    def callback(ctx: Any, results: Any, *operands: Any) -> None:
        stream = _xla_stream(ctx)
        if stream is None:
            _host_kvcache(config, results, dict(zip(config.names, operands)))
            runs["cpu", "kvcache"] += 1
            return
        cupy = _interop.cupy_module()
        views: dict[str, Any] = dict.fromkeys(_kvcache.KV_NAMES)
        views.update((n, _cupy_view(x)) for n, x in zip(config.names, operands))
        device = views["q"].data.device_id
        with cupy.cuda.Device(device), _cupy_stream(stream, device):
            given = {"out": _cupy_view(results[0])}
            if config.return_lse:
                given["lse"] = _cupy_view(results[1])
            if config.appends:  # the kernels append into XLA's result buffers, the caches' own when aliased
                for name, result in zip(("k_cache", "v_cache"), results[-2:]):
                    views[name] = _cache_result(views[name], _cupy_view(result), lambda x: x.data.ptr)
            # By name only: the executor reads ``named`` (the operands' tuple is the front door's).
            call = _kvcache.CacheCall(
                views, (), config.options, config.num_splits, config.rotary, batch_invariant=config.batch_invariant
            )
            _kvcache.gpu_with_kvcache(_interop.CUPY_LIB, device, call, config.return_lse, given)
        runs["gpu", "kvcache"] += 1

    return callback


def _cache_result(cache: Any, result: Any, address: Any) -> Any:
    """The result buffer of an appended cache, holding the cache: XLA hands the cache's own
    buffer (input_output_aliases) unless it could not alias, then a fresh one, filled here."""
    if address(result) != address(cache):
        result[...] = cache
    return result


def _xla_stream(ctx: Any) -> int | None:
    """XLA's stream for this call on a GPU, or None on the CPU backend, which has no GPU context
    (jax 0.10 raises there). Taken for the CPU wrongly, GPU buffers would fail loudly in
    ``np.asarray``, never run a host computation."""
    try:
        stream = ctx.stream
    except Exception:
        return None
    return int(stream) if stream else None


# ---------------------------------------------------------------------------------------------
# GPU buffers as CuPy arrays, XLA's stream as CuPy's current stream.
# ---------------------------------------------------------------------------------------------
def _cupy_view(buffer: Any) -> Any:
    """An XLA device buffer as a CuPy array over the same memory (kept alive by ``buffer``)."""
    cupy = _interop.cupy_module()
    interface = buffer.__cuda_array_interface__
    shape = tuple(interface["shape"])
    dtype = np.dtype(buffer.dtype)  # bfloat16 as ml_dtypes' (the interface's typestr cannot say it)
    ptr = int(interface["data"][0])
    size = math.prod(shape) * dtype.itemsize
    device = -1 if ptr else _interop.current_device()  # -1: CuPy asks the pointer's device
    memory = cupy.cuda.UnownedMemory(ptr, size, buffer, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), interface.get("strides"))


class _StreamHandle:
    """XLA's stream pointer in the CUDA stream protocol (``cupy.cuda.Stream.from_external``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_streams: dict[tuple[int, int], Any] = {}


def _cupy_stream(ptr: int, device: int) -> Any:
    """A CuPy stream object for XLA's stream, made once per (stream, device)."""
    stream = _streams.get((ptr, device))
    if stream is None:
        cuda = _interop.cupy_module().cuda
        if len(_streams) > 64:
            _streams.clear()
        try:  # CuPy >= 14; ExternalStream (deprecated there) before
            stream = cuda.Stream.from_external(_StreamHandle(ptr))
        except (AttributeError, TypeError):
            stream = cuda.ExternalStream(ptr, device)
        _streams[ptr, device] = stream
    return stream


def _gpu_seed(seed: Any) -> int | None:
    """The seed operand's value on the host: a 2-word copy that waits for XLA's stream (the
    kernels take the seed as a launch parameter), paid only by calls with dropout."""
    return None if seed is None else _seed_value(_cupy_view(seed).get())


# ---------------------------------------------------------------------------------------------
# The CPU backend: the host path on NumPy views of XLA's buffers.
# ---------------------------------------------------------------------------------------------
def _host_array(buffer: Any) -> Any:
    """A CPU buffer as NumPy; bfloat16 as float32 (the host path computes in float32 anyway,
    and no array-API namespace takes NumPy's ml_dtypes bfloat16)."""
    x = np.asarray(buffer)
    return x.astype(np.float32) if x.dtype.name == "bfloat16" else x


def _host_forward(
    config: Config, results: Any, q: Any, k: Any, v: Any, seed: Any, slopes: Any, sinks: Any, mod_arrays: Any
) -> None:
    call = _attention.Forward(
        _host_array(q), _host_array(k), _host_array(v), config.options, config.layout, config.algorithm,
        config.deterministic, config.dropout_p, None if seed is None else _seed_value(np.asarray(seed)),
        None if slopes is None else np.asarray(slopes), mods=_mods_on(config, mod_arrays, _host_array),
        batch_invariant=config.batch_invariant, sinks=None if sinks is None else np.asarray(sinks),
    )  # fmt: skip
    out, lse = _attention.host_forward(call)
    np.asarray(results[0])[...] = out
    if len(results) > 1:
        np.asarray(results[1])[...] = lse


def _host_backward(
    config: Config, results: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any, seed: Any,
    slopes: Any, sinks: Any, mod_arrays: Any, captured: bool = False,
) -> None:  # fmt: skip
    call = _attention.Backward(
        _host_array(dout), _host_array(q), _host_array(k), _host_array(v), _host_array(out), np.asarray(lse),
        None if dlse is None else np.asarray(dlse), config.options, config.layout, config.deterministic,
        config.dropout_p, None if seed is None else _seed_value(np.asarray(seed)),
        None if slopes is None else np.asarray(slopes), mods=_mods_on(config, mod_arrays, _host_array),
        sinks=None if sinks is None else np.asarray(sinks), captured_grads=captured,
    )  # fmt: skip
    grads = _attention.backward(call)
    if captured:  # dq, dk, dv (dsinks), then score_mod's float arrays' gradients
        grads = (*grads[:-1], *(g for g in grads[-1] if g is not None))
    for buffer, grad in zip(results, grads, strict=True):
        np.asarray(buffer)[...] = grad


def _host_kvcache(config: KvConfig, results: Any, operands: dict[str, Any]) -> None:
    """The cache call's host path (``_host.attention_with_kvcache`` through the entry, as an eager
    call on NumPy arrays), appending into the caches' result buffers."""
    arrays = dict.fromkeys(_kvcache.KV_NAMES) | {n: _host_array(x) for n, x in operands.items()}
    caches = []
    if config.appends:
        for name, result in zip(("k_cache", "v_cache"), results[-2:]):
            buffer = _cache_result(np.asarray(operands[name]), np.asarray(result), lambda x: x.ctypes.data)
            arrays[name] = _host_array(buffer)  # the buffer itself, or a float32 copy of a bfloat16 one
            caches.append((buffer, arrays[name]))
    call = _kvcache.cache_call(
        arrays, config.options, config.num_splits, config.rotary, batch_invariant=config.batch_invariant
    )
    out, lse = _kvcache.with_kvcache(call, want_lse=True)
    np.asarray(results[0])[...] = out
    if config.return_lse:
        np.asarray(results[1])[...] = lse
    for buffer, appended in caches:
        if appended is not buffer:
            buffer[...] = appended
