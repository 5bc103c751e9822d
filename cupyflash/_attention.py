"""The executors of ``attention``, ``attention_varlen`` and their backward twins: a checked call
(``Forward``, ``VarlenForward``, ``Backward``, ``VarlenBackward``) in, its results out, on the
device its arrays live on. On the GPU: ``Problem`` -> a ``Launch`` looked up by the call's
signature or planned (``_plan``, pure) -> ``_launch.run`` on the caller's stream. On the host: the
array-API algorithms (``_host``).

The front door (``_front``) calls them after it has routed a call past torch.compile, JAX
tracing and autograd; the PyTorch custom ops (``_torch_ops``) and the JAX custom calls (``_jax``)
call them from their bodies. Nothing here asks which framework is tracing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _baselines_gpu, _block_mask, _device, _host, _interop, _launch, _mod_tiles, _mods, _plan
from ._validate import (
    LAYOUTS,
    Options,
    Problem,
    attention_problem,
    check_alibi,
    check_attn_mask,
    check_dropout,
    check_sinks,
    normalize_window,
    split_dims,
    varlen_problem,
)
from .xp_impl import Dropout

# The plans, by call signature (library, device, shapes, dtypes, options): the plain forward's
# (``gpu_forward``, whose call site reads its recent plans first) and the others'.
_forward_plans = _plan.new_cache()
_plans = _plan.new_cache()


# ---------------------------------------------------------------------------------------------
# The calls, checked. Not changed once built (``on`` and ``prepared`` make changed copies, each
# by its constructor: dataclasses.replace cost ~1.2 us); not frozen, since a frozen dataclass's
# __init__ cost a call 0.8 us more.
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Forward:
    """One ``attention`` call: q, k, v ``(B, N, H, d)`` (or bhsd) and its checked options."""

    q: Any
    k: Any
    v: Any
    options: Options
    layout: str = "bshd"
    algorithm: str = "auto"
    deterministic: bool = False  # the backward's, where autograd differentiates the call
    dropout_p: float = 0.0
    seed: int | None = None
    alibi_slopes: Any = None
    attn_mask: Any = None
    mods: Any = None  # (score_mod, mask_mod) traced (_mods.Mod or None each; as given while Dynamo traces), or None
    batch_invariant: bool = False  # each sequence's result independent of the batch (the decode kernel's splits)
    sinks: Any = None  # learnable sinks (Hq,): a logit per head in every row's softmax denominator
    block_mask: Any = None  # a BlockMask (_block_mask): mods' mask_mod with its block summary
    captured_grad: bool = False  # a tensor the functions capture requires grad: autograd's route

    names = ("q", "k", "v", "alibi_slopes", "attn_mask", "sinks")
    writes = False  # into none of its arrays

    def arrays(self) -> tuple[Any, ...]:
        return (self.q, self.k, self.v, self.alibi_slopes, self.attn_mask, self.sinks)

    def prepared(self) -> Forward:
        """Dropout checked (a traced seed stays as given for the JAX route, which takes it) and
        ALiBi slopes that require grad refused: the steps after the JAX route. A call without
        dropout or ALiBi is itself (its check inline: a second call cost the hot path ~40 ns)."""
        if self.alibi_slopes is None and self.seed is None and type(self.dropout_p) is float and not self.dropout_p:
            return self
        dropout_p, seed = _prepared(self)
        return Forward(
            self.q, self.k, self.v, self.options, self.layout, self.algorithm, self.deterministic, dropout_p, seed,
            self.alibi_slopes, self.attn_mask, self.mods, self.batch_invariant, self.sinks, self.block_mask,
            self.captured_grad,
        )  # fmt: skip

    def on(self, arrays: list[Any]) -> Forward:
        """The same call on ``arrays`` (``names``' order), as the pipeline reads them."""
        q, k, v, slopes, mask, sinks = arrays
        return Forward(
            q, k, v, self.options, self.layout, self.algorithm, self.deterministic, self.dropout_p, self.seed, slopes,
            mask, self.mods, self.batch_invariant, sinks, self.block_mask, self.captured_grad,
        )  # fmt: skip


@dataclass(slots=True)
class VarlenForward:
    """One ``attention_varlen`` call: q ``(total_q, Hq, d)``, k, v ``(total_k, Hkv, d)`` (or pages
    with ``block_table``), split by the int32 offsets."""

    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: int
    max_seqlen_k: int
    options: Options
    algorithm: str = "auto"
    deterministic: bool = False
    dropout_p: float = 0.0
    seed: int | None = None
    alibi_slopes: Any = None
    seqused_k: Any = None
    block_table: Any = None
    batch_invariant: bool = False  # the Hopper variant not chosen by the batch's longest sequence
    sinks: Any = None
    mods: Any = None  # (score_mod, mask_mod) traced, or None: b the sequence, q_idx / kv_idx positions in it
    captured_grad: bool = False  # a tensor score_mod captures requires grad: autograd's route

    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "seqused_k", "block_table", "sinks")
    writes = False

    def arrays(self) -> tuple[Any, ...]:
        return (self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, self.alibi_slopes, self.seqused_k,
                self.block_table, self.sinks)  # fmt: skip

    def prepared(self) -> VarlenForward:
        if self.alibi_slopes is None and self.seed is None and type(self.dropout_p) is float and not self.dropout_p:
            return self
        dropout_p, seed = _prepared(self)
        return VarlenForward(
            self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k,
            self.options, self.algorithm, self.deterministic, dropout_p, seed, self.alibi_slopes, self.seqused_k,
            self.block_table, self.batch_invariant, self.sinks, self.mods, self.captured_grad,
        )  # fmt: skip

    def on(self, arrays: list[Any]) -> VarlenForward:
        q, k, v, cu_q, cu_k, slopes, seqused_k, table, sinks = arrays
        return VarlenForward(
            q, k, v, cu_q, cu_k, self.max_seqlen_q, self.max_seqlen_k, self.options, self.algorithm,
            self.deterministic, self.dropout_p, self.seed, slopes, seqused_k, table, self.batch_invariant, sinks,
            self.mods, self.captured_grad,
        )  # fmt: skip


@dataclass(slots=True)
class Backward:
    """The gradients of one ``attention`` call at (out, lse), for ``dout`` (and ``dlse``)."""

    dout: Any
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    dlse: Any
    options: Options
    layout: str = "bshd"
    deterministic: bool = False
    dropout_p: float = 0.0
    seed: int | None = None  # required with dropout: the forward's mask is regenerated from it
    alibi_slopes: Any = None
    attn_mask: Any = None
    mods: Any = None  # the forward's (score_mod, mask_mod), traced
    sinks: Any = None  # the forward's sinks (Hq,): their gradient is a fourth result
    block_mask: Any = None  # the forward's BlockMask
    captured_grads: bool = False  # one more result: the gradients of score_mod's captured arrays

    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "alibi_slopes", "attn_mask", "sinks")

    def arrays(self) -> tuple[Any, ...]:
        return (self.dout, self.q, self.k, self.v, self.out, self.lse, self.dlse, self.alibi_slopes, self.attn_mask,
                self.sinks)  # fmt: skip

    def on(self, arrays: list[Any]) -> Backward:
        dout, q, k, v, out, lse, dlse, slopes, mask, sinks = arrays
        return Backward(
            dout, q, k, v, out, lse, dlse, self.options, self.layout, self.deterministic, self.dropout_p, self.seed,
            slopes, mask, self.mods, sinks, self.block_mask, self.captured_grads,
        )  # fmt: skip


@dataclass(slots=True)
class VarlenBackward:
    """The gradients of one ``attention_varlen`` call; ``lse`` and ``dlse`` are ``(Hq, total_q)``."""

    dout: Any
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    dlse: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: int
    max_seqlen_k: int
    options: Options
    deterministic: bool = False
    dropout_p: float = 0.0
    seed: int | None = None
    alibi_slopes: Any = None
    seqused_k: Any = None
    sinks: Any = None
    mods: Any = None  # the forward's (score_mod, mask_mod), traced
    captured_grads: bool = False  # one more result: the gradients of score_mod's captured arrays

    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "seqused_k",
             "sinks")  # fmt: skip

    def arrays(self) -> tuple[Any, ...]:
        return (self.dout, self.q, self.k, self.v, self.out, self.lse, self.dlse, self.cu_seqlens_q,
                self.cu_seqlens_k, self.alibi_slopes, self.seqused_k, self.sinks)  # fmt: skip

    def on(self, arrays: list[Any]) -> VarlenBackward:
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, slopes, seqused_k, sinks = arrays
        return VarlenBackward(
            dout, q, k, v, out, lse, dlse, cu_q, cu_k, self.max_seqlen_q, self.max_seqlen_k, self.options,
            self.deterministic, self.dropout_p, self.seed, slopes, seqused_k, sinks, self.mods, self.captured_grads,
        )  # fmt: skip


def _prepared(call: Forward | VarlenForward) -> tuple[float, int | None]:
    """``prepared``'s checks: slopes that require grad refused, the dropout options checked."""
    if call.alibi_slopes is not None:
        _interop.refuse_slope_grad(call.alibi_slopes)
    dropout_p, seed = call.dropout_p, call.seed
    if dropout_p or seed is not None or type(dropout_p) is not float:  # the default skips the checks
        return check_dropout(dropout_p, seed)
    return dropout_p, seed


# ---------------------------------------------------------------------------------------------
# Problems: the arrays' shapes against the options (``_validate``), built once per call.
# ---------------------------------------------------------------------------------------------
def problem_of(q: Any, k: Any, v: Any, options: Options, layout: str, dropout_p: float = 0.0,
               alibi_slopes: Any = None, sinks: Any = None) -> Problem:  # fmt: skip
    """The ``Problem`` of a dense call (every array checked to be one)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array (CuPy, PyTorch, JAX, NumPy ...), got {type(x).__name__}")
    problem = attention_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), causal=options.causal, scale=options.scale,
        window=options.window, softcap=options.softcap, layout=layout, dropout_p=dropout_p,
    )  # fmt: skip
    return _with_head_arrays(problem, alibi_slopes, sinks)


def forward_problem(call: Forward) -> tuple[Problem, Any]:
    """A forward's problem and its attn_mask as 4-D (None without one)."""
    problem = problem_of(
        call.q, call.k, call.v, call.options, call.layout, call.dropout_p, call.alibi_slopes, call.sinks
    )
    return with_mask(problem, call.attn_mask)


def with_mask(problem: Problem, attn_mask: Any) -> tuple[Problem, Any]:
    """The problem with its (checked) attn_mask's kind and 4-D shape, and the mask as 4-D."""
    if attn_mask is None:
        return problem, None
    if not hasattr(attn_mask, "shape") or not hasattr(attn_mask, "dtype"):
        raise TypeError(f"attn_mask must be an array, got {type(attn_mask).__name__}")
    kind, shape = check_attn_mask(tuple(attn_mask.shape), "bool" in str(attn_mask.dtype), problem)
    mask = attn_mask if attn_mask.ndim == 4 else attn_mask.reshape(shape)
    return dataclasses.replace(problem, mask=kind, mask_shape=shape), mask


def _with_head_arrays(problem: Problem, alibi_slopes: Any, sinks: Any) -> Problem:
    """The problem with the kind of its (checked) ALiBi slopes and sinks, against its batch and heads."""
    if alibi_slopes is None and sinks is None:
        return problem
    return dataclasses.replace(
        problem, alibi=check_alibi(alibi_slopes, problem.batch, problem.heads_q),
        sinks=check_sinks(sinks, problem.heads_q),
    )  # fmt: skip


def varlen_problem_of(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, options: Options, dropout_p: float = 0.0,
    alibi_slopes: Any = None, seqused_k: Any = None, block_table: Any = None, sinks: Any = None,
) -> Problem:  # fmt: skip
    """The ``Problem`` of a packed call (its offsets' shapes checked; their values where they live)."""
    problem = varlen_problem(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(cu_q.shape), tuple(cu_k.shape), max_q, max_k,
        causal=options.causal, scale=options.scale, window=options.window, softcap=options.softcap,
        dropout_p=dropout_p, seqused_k_shape=None if seqused_k is None else tuple(seqused_k.shape),
        block_table_shape=None if block_table is None else tuple(block_table.shape),
    )  # fmt: skip
    return _with_head_arrays(problem, alibi_slopes, sinks)


def _varlen_call_problem(call: VarlenForward | VarlenBackward, block_table: Any = None) -> Problem:
    return varlen_problem_of(
        call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
        call.options, call.dropout_p, call.alibi_slopes, call.seqused_k, block_table, call.sinks,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Forward.
# ---------------------------------------------------------------------------------------------
def forward(call: Forward, want_lse: bool) -> tuple[Any, Any]:
    """``attention`` where its arrays live: (out, lse), lse None on the GPU unless wanted."""
    return _where_they_live(call, host_forward, gpu_forward, want_lse)


def _where_they_live(
    call: Any, host: Callable[[Any], tuple[Any, Any]], gpu: Callable[..., tuple[Any, Any]], want_lse: bool
) -> tuple[Any, Any]:
    """A forward call on the host or on the GPU its arrays share (adopted as the pipeline reads
    them): the custom ops' and the JAX host callbacks' way in, past the front door's routing."""
    found = _interop.gpu_arrays(call.names, call.arrays())
    if found is None:
        return host(call)
    lib, device, arrays = found
    return gpu(lib, device, call.on(arrays), want_lse)


def host_forward(call: Forward) -> tuple[Any, Any]:
    problem, mask = forward_problem(call)
    if call.block_mask is not None:  # (the host path evaluates its mask_mod: the summary saves no work here)
        _check_block_mask(call.block_mask, problem)
    dropout = host_dropout(call.q, call.dropout_p, call.seed)
    score_mod, mask_mod = (None, None) if call.mods is None else call.mods
    return _host.attention(
        call.q, call.k, call.v, problem, call.algorithm, dropout, call.alibi_slopes, mask, score_mod, mask_mod,
        batch_invariant=call.batch_invariant, sinks=call.sinks,
    )  # fmt: skip


def gpu_forward(
    lib: _interop.ArrayLib, device: int, call: Forward, want_lse: bool, given: Any = _launch.EMPTY
) -> tuple[Any, Any]:
    """The kernels' forward on arrays the pipeline reads: (out, lse), lse None unless wanted.
    ``given``: output buffers to write, by name (``_launch.run``; XLA's under ``jax.jit``)."""
    if call.mods is not None:
        bounds = _mask_as_bounds(call)
        if bounds is None:
            return _gpu_mods(lib, device, call, want_lse, given)
        call = Forward(
            call.q, call.k, call.v, bounds, call.layout, call.algorithm, call.deterministic, call.dropout_p, call.seed,
            call.alibi_slopes, call.attn_mask, None, call.batch_invariant, call.sinks,
        )  # fmt: skip
    if call.attn_mask is not None:
        return _gpu_masked(lib, device, call, want_lse)
    q, k, v, slopes, sinks = call.q, call.k, call.v, call.alibi_slopes, call.sinks
    key: tuple[Any, ...]
    if slopes is None and sinks is None:  # most calls: two key parts and two operands fewer (~40 ns)
        key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, call.options, call.layout,
               call.algorithm, call.dropout_p, call.batch_invariant)  # fmt: skip
        arrays_by_name = {"q": q, "k": k, "v": v}
    else:
        key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, call.options, call.layout,
               call.algorithm, call.dropout_p, call.batch_invariant, _shapes(slopes, sinks),
               _dtypes(slopes, sinks))  # fmt: skip
        arrays_by_name = {"q": q, "k": k, "v": v, "alibi_slopes": slopes, "sinks": sinks}
    (key0, plan0), (key1, plan1) = _forward_plans.recent
    if key == key0:
        launch = plan0
    elif key == key1:
        launch = plan1
    else:
        launch = _forward_plans.lookup(key, _plan_forward, lib, device, call)
    if call.dropout_p:
        arrays_by_name["dropout_seed"] = gpu_seed(lib, device, q, call.seed)
    return _launch.run(launch, lib, device, arrays_by_name, want_lse, given)


def _plan_forward(lib: _interop.ArrayLib, device: int, call: Forward) -> _plan.Launch:
    problem, _ = forward_problem(call)
    dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(call.q), "k": lib.dtype_name(call.k),
                                    "v": lib.dtype_name(call.v)})  # fmt: skip
    _check_slopes_dtype(lib, call.alibi_slopes)
    _check_sinks_dtype(lib, call.sinks)
    info = _device.device_info(device)
    if call.algorithm in ("fa1", "naive"):
        if call.dropout_p or call.alibi_slopes is not None or call.sinks is not None:
            raise ValueError(
                f"the GPU baseline algorithm={call.algorithm!r} has no dropout, ALiBi or sinks: use 'auto' or 'fa2'"
            )
        if call.batch_invariant and call.algorithm == "naive":
            raise ValueError(
                "batch_invariant=True runs on the flash kernels: the GPU baseline algorithm='naive' multiplies by "
                "cuBLAS, which picks its GEMM algorithm by the batch too; use 'auto', 'fa2', 'fa3', 'decode' or 'fa1'"
            )
        return _baselines_gpu.plan_baseline(problem, dtype, info, call.algorithm)
    return _plan.plan_attention(
        problem, dtype, info, call.algorithm, tuple(call.q.shape), batch_invariant=call.batch_invariant
    )


# A mask_mod (its key) that is a causal or sliding-window bound and nothing else: the bound
# (_mods.exact_window), or None.
_exact_windows: dict[Any, tuple[int, int] | None] = {}


def _mask_as_bounds(call: Forward | Backward) -> Options | None:
    """The call's options with its mask_mod as the bound it is, where it is one and the call's
    rows and keys align (Nq = Nk: q_idx >= kv_idx is then the kernels' causal bound; as
    ``with_implied_bounds``), with no score_mod and no bound of its own; else None. Such a mask
    (``kv_idx <= q_idx``, a sliding window) then runs as the built-in bound, on the kernels without
    a score hook: the same scores shown, none of the hook's work (its BlockMask, made from the
    same mask, hides the tiles the bound skips)."""
    if call.layout not in LAYOUTS:
        return None
    batch, rows, heads, _ = split_dims(tuple(call.q.shape), call.layout)
    keys = split_dims(tuple(call.k.shape), call.layout)[1]
    if rows != keys:
        return None
    bounds = _exact_bounds(call.mods, call.options)
    if bounds is not None and call.block_mask is not None:  # made for this call (the hook's route checks it)
        _block_mask.check_call(call.block_mask, batch, heads, rows, keys)
    return bounds


def _exact_bounds(mods: tuple[Any, Any], options: Options) -> Options | None:
    """``options`` with the mask_mod of ``mods`` as the causal / window bound it is exactly (no
    score_mod, no bound of its own), or None: for a call whose rows and keys align."""
    score_mod, mask_mod = mods
    if score_mod is not None or not isinstance(mask_mod, _mods.Mod) or options.causal or options.window != (-1, -1):
        return None
    key = mask_mod.key
    try:  # (one lookup: the key hashes the whole expression)
        window = _exact_windows[key]
    except KeyError:
        if len(_exact_windows) >= _plan.PlanCache.MAX_ENTRIES:  # a process of endless new functions
            _exact_windows.clear()
        window = _exact_windows[key] = _mods.exact_window(mask_mod)
    if window is None:
        return None
    return Options(window[1] == 0, options.scale, window, options.softcap)


def packed_rows_align(call: VarlenForward | VarlenBackward) -> bool:
    """Whether every packed sequence has as many queries as keys, known on the host: one offsets
    array for both (self-attention over packed sequences, as training passes them), equal
    maxima, no seqused_k. A mask_mod's q_idx / kv_idx bounds (top left) are then the kernels'
    causal / window bounds (bottom right), as a dense call's where Nq = Nk."""
    return call.cu_seqlens_q is call.cu_seqlens_k and call.max_seqlen_q == call.max_seqlen_k and call.seqused_k is None


# The device code of each score_mod / mask_mod pair met, by their keys (the expressions, with
# their arrays' shapes and dtypes): a call traces its functions again, but writes no code twice.
_kernel_mods: dict[Any, _mods.KernelMods] = {}


def _gpu_mods(
    lib: _interop.ArrayLib, device: int, call: Forward, want_lse: bool, given: Any = _launch.EMPTY
) -> tuple[Any, Any]:
    """attention with a score_mod / mask_mod: the FA2 kernel with the functions compiled into its
    score hook (kernels_cu/variants.cuh's UserMods), their captured arrays read where they are
    (on q's device, of q's library); with a block_mask, its summary read beside them (without
    one, the summary the mask_mod implies, where it decides some cell: _block_mask.implied)."""
    mods_key, kernel, buffers = _kernel_mods_of(call, device)
    q, k, v = call.q, call.k, call.v
    sinks, block_mask = call.sinks, call.block_mask
    if block_mask is None and call.mods[1] is not None and call.layout in LAYOUTS:
        batch, rows, heads, _ = split_dims(tuple(q.shape), call.layout)
        keys = split_dims(tuple(k.shape), call.layout)[1]
        block_mask = _block_mask.implied_on(call.mods[1], batch, heads, rows, keys, lib, device, kernel)
    cells = None if block_mask is None else _block_mask.layout(block_mask)
    key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, call.options, call.layout,
           call.algorithm, call.dropout_p, call.alibi_slopes is not None, mods_key,
           _shapes(sinks), _dtypes(sinks), cells, None if block_mask is None else block_mask.shape)  # fmt: skip

    def plan() -> _plan.Launch:
        problem = forward_problem(call)[0]
        if block_mask is not None:
            _check_block_mask(block_mask, problem)
        problem = with_implied_bounds(problem, call.mods[1])
        dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
        _check_sinks_dtype(lib, sinks)
        info = _device.device_info(device)
        return _plan.plan_attention(problem, dtype, info, call.algorithm, tuple(q.shape), mods=kernel, cells=cells)

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "sinks": sinks, **{f"mod_buffer{i}": x for i, x in enumerate(buffers)}}
    if block_mask is not None:
        arrays_by_name.update(_block_mask_buffers(block_mask, lib, device))
    return _launch.run(launch, lib, device, arrays_by_name, want_lse, given)


def _check_block_mask(block_mask: Any, problem: Problem) -> None:
    _block_mask.check_call(block_mask, problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k)


def _block_mask_buffers(block_mask: Any, lib: _interop.ArrayLib, device: int) -> dict[str, int]:
    """A BlockMask's summary on ``device``, by address, under the names of its plan's operands."""
    cells, key_ranges, row_ranges = _block_mask.kernel_buffers(block_mask, lib, device)
    return {"mask_cells": cells, "mask_key_ranges": key_ranges, "mask_row_ranges": row_ranges}


def _kernel_mods_of(call: Forward | Backward, device: int) -> tuple[Any, _mods.KernelMods, tuple[Any, ...]]:
    """A dense GPU call's score_mod / mask_mod (``_kernel_mods_for``), the reads its index ranges
    keep inside their arrays unchecked."""
    grid = None  # the call's index ranges: the reads they keep inside their arrays go unchecked
    if call.layout in LAYOUTS:
        batch, rows, heads, _ = split_dims(tuple(call.q.shape), call.layout)
        grid = _mods.Grid(batch, heads, rows, split_dims(tuple(call.k.shape), call.layout)[1])
    return _kernel_mods_for(call.mods, call.q, grid, device)


def _kernel_mods_for(
    mods: tuple[Any, Any], q: Any, grid: _mods.Grid | None, device: int
) -> tuple[Any, _mods.KernelMods, tuple[Any, ...]]:
    """A GPU call's score_mod / mask_mod: their key, their device code (written once per key and
    index ranges ``grid``: the reads those keep inside their arrays unchecked, _mods.Grid; None:
    every read checked) and their captured arrays in mod_buffer order, adopted as q was (one
    library, q's device)."""
    score_mod, mask_mod = mods
    mods_key = (None if score_mod is None else score_mod.key, None if mask_mod is None else mask_mod.key)
    kernel = _kernel_mods.get((mods_key, grid))
    if kernel is None:
        if len(_kernel_mods) >= _plan.PlanCache.MAX_ENTRIES:  # a process of endless new functions
            _kernel_mods.clear()
        # with the mask's own tile classes (_mod_tiles): hidden tiles skipped, plain ones unmasked
        source = _mod_tiles.kernel_source(mask_mod)
        kernel = _kernel_mods.setdefault((mods_key, grid), _mods.kernel_mods(score_mod, mask_mod, source, grid))
    captured = kernel.arrays(score_mod, mask_mod)
    names = tuple(f"{('score_mod', 'mask_mod')[which]}'s captured array {slot}" for which, slot in kernel.buffers)
    # One library on q's device (an array elsewhere is refused there, named), adopted as q was.
    found = _interop.gpu_arrays(("q", *names), (q, *captured))
    assert found is not None and found[1] == device
    return mods_key, kernel, tuple(found[2][1:])


def with_implied_bounds(problem: Problem, mask_mod: _mods.Mod | None) -> Problem:
    """The problem with the causal / window bounds ``mask_mod`` implies (``_mods.implied_window``)
    where it has none of its own and its rows and keys align (Nq = Nk: the mask's q_idx <= kv_idx
    is the kernels' causal bound then), so that the kernels skip the tiles those bounds hide. The
    mask still runs on every score: the result is the mask's alone."""
    bounded = problem.window_left >= 0 or problem.window_right >= 0
    if mask_mod is None or bounded or problem.seqlen_q != problem.seqlen_k:
        return problem
    left, right = _mods.implied_window(mask_mod)
    if left < 0 and right < 0:
        return problem
    left, right = normalize_window(right == 0, (left, right), problem.seqlen_q, problem.seqlen_k)
    return dataclasses.replace(problem, window_left=left, window_right=right)


def _gpu_masked(lib: _interop.ArrayLib, device: int, call: Forward, want_lse: bool) -> tuple[Any, Any]:
    """attention with an attn_mask: the FA2 kernel with the mask as a score variant."""
    problem, mask = forward_problem(call)
    q, k, v = call.q, call.k, call.v
    key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, mask.dtype, problem, call.layout,
           call.algorithm, call.batch_invariant, _dtypes(call.sinks))  # fmt: skip

    def plan() -> _plan.Launch:
        dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
        _check_mask_dtype(lib, problem, mask, dtype)
        _check_sinks_dtype(lib, call.sinks)
        info = _device.device_info(device)
        return _plan.plan_attention(
            problem, dtype, info, call.algorithm, tuple(q.shape), batch_invariant=call.batch_invariant
        )

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "attn_mask": mask, "sinks": call.sinks}
    if call.dropout_p:
        arrays_by_name["dropout_seed"] = gpu_seed(lib, device, q, call.seed)
    return _launch.run(launch, lib, device, arrays_by_name, want_lse)


def varlen_forward(call: VarlenForward, want_lse: bool) -> tuple[Any, Any]:
    """``attention_varlen`` where its arrays live: (out, lse), lse None on the GPU unless wanted."""
    return _where_they_live(call, host_varlen_forward, gpu_varlen_forward, want_lse)


def host_varlen_forward(call: VarlenForward) -> tuple[Any, Any]:
    problem = _varlen_call_problem(call, call.block_table)
    if call.block_table is not None:
        return _host.attention_varlen(
            call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, problem, None, call.alibi_slopes,
            call.seqused_k, block_table=call.block_table, sinks=call.sinks,
        )  # fmt: skip
    dropout = host_dropout(call.q, call.dropout_p, call.seed)
    score_mod, mask_mod = (None, None) if call.mods is None else call.mods
    return _host.attention_varlen(
        call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, problem, dropout, call.alibi_slopes,
        call.seqused_k, sinks=call.sinks, score_mod=score_mod, mask_mod=mask_mod,
    )  # fmt: skip


def gpu_varlen_forward(lib: _interop.ArrayLib, device: int, call: VarlenForward, want_lse: bool) -> tuple[Any, Any]:
    """The kernels of a packed call on arrays the pipeline reads: (out, lse). The plan is looked up
    by the call's arguments as given (the Problem is built from them and nothing else, so it is
    checked once per plan: building it per call cost ~6 us)."""
    if call.block_table is not None:
        return _gpu_paged_varlen(lib, device, call, want_lse)
    if call.mods is not None:
        bounds = _exact_bounds(call.mods, call.options) if packed_rows_align(call) else None
        if bounds is None:
            return _gpu_varlen_mods(lib, device, call, want_lse)
        call = dataclasses.replace(call, options=bounds, mods=None)  # the mask is that bound: no hook
    q, k, v, cu_q, cu_k, slopes, seqused_k = (
        call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.alibi_slopes, call.seqused_k
    )  # fmt: skip
    key = (
        lib.name, device, q.shape, k.shape, v.shape, cu_q.shape, cu_k.shape, _maxima(call), call.options,
        call.dropout_p, q.dtype, k.dtype, v.dtype, cu_q.dtype, cu_k.dtype,
        None if slopes is None else (slopes.shape, slopes.dtype),
        None if seqused_k is None else (seqused_k.shape, seqused_k.dtype), call.algorithm, call.batch_invariant,
        _shapes(call.sinks), _dtypes(call.sinks),
    )  # fmt: skip
    try:
        launch = _plans.find(key)
    except TypeError:
        launch = None
    if launch is None:
        launch = _plans.get(key, lambda: _plan_varlen(lib, device, call))
    arrays_by_name = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "alibi_slopes": slopes,
                      "seqused_k": seqused_k, "sinks": call.sinks}  # fmt: skip
    if call.dropout_p:
        arrays_by_name["dropout_seed"] = gpu_seed(lib, device, q, call.seed)
    return _launch.run(launch, lib, device, arrays_by_name, want_lse)


def _maxima(call: VarlenForward) -> tuple[int, int]:
    """(max_seqlen_q, max_seqlen_k) for a plan key: Python ints as they are; anything else
    checked first (a bool or a float equal to an int must not find that int's plan)."""
    max_q, max_k = call.max_seqlen_q, call.max_seqlen_k
    if type(max_q) is not int or type(max_k) is not int:
        problem = _varlen_call_problem(call, call.block_table)
        return problem.seqlen_q, problem.seqlen_k
    return max_q, max_k


def _plan_varlen(
    lib: _interop.ArrayLib, device: int, call: VarlenForward, mods: _mods.KernelMods | None = None,
    aligned: bool = False,
) -> _plan.Launch:  # fmt: skip
    """``aligned``: the sequences' rows and keys align (``packed_rows_align``), so that the bounds
    a mask_mod implies bound the kernels' tiles too."""
    q, k, v = call.q, call.k, call.v
    problem = _varlen_call_problem(call)
    if aligned and call.mods is not None:
        problem = with_implied_bounds(problem, call.mods[1])
    dtype = _plan.check_gpu_dtypes({"q": lib.dtype_name(q), "k": lib.dtype_name(k), "v": lib.dtype_name(v)})
    _check_offset_dtypes(lib, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k)
    _check_slopes_dtype(lib, call.alibi_slopes)
    _check_sinks_dtype(lib, call.sinks)
    rows = (q.shape[0], k.shape[0])
    return _plan.plan_forward(
        problem, dtype, _device.device_info(device), call.algorithm, q_shape=tuple(q.shape), packed_rows=rows,
        mods=mods, batch_invariant=call.batch_invariant,
    )  # fmt: skip


def _gpu_varlen_mods(lib: _interop.ArrayLib, device: int, call: VarlenForward, want_lse: bool) -> tuple[Any, Any]:
    """attention_varlen with a score_mod / mask_mod: the packed kernels with the functions in their
    score hook (as ``_gpu_mods``), b the sequence and q_idx, kv_idx its own positions. No
    BlockMask (one is per padded call): the FA2 kernel classes its tiles by the mask's own bounds
    (_mod_tiles), the Hopper kernels run the mask on every tile the causal / window bounds leave,
    and where the sequences' rows and keys align (``packed_rows_align``) the bounds the mask
    implies are those (``with_implied_bounds``). Every captured read is checked (the offsets,
    hence the positions' ranges, stay on the device)."""
    mods_key, kernel, buffers = _kernel_mods_for(call.mods, call.q, None, device)
    q, k, v, cu_q, cu_k, seqused_k, sinks = (
        call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k, call.sinks
    )  # fmt: skip
    aligned = packed_rows_align(call)
    key = ("varlen-mods", lib.name, device, q.shape, k.shape, v.shape, cu_q.shape, cu_k.shape, _maxima(call),
           call.options, call.dropout_p, call.algorithm, call.batch_invariant, mods_key, aligned,
           _dtypes(q, k, v, cu_q, cu_k, call.alibi_slopes, seqused_k, sinks),
           _shapes(call.alibi_slopes, seqused_k, sinks))  # fmt: skip
    launch = _plans.get(key, lambda: _plan_varlen(lib, device, call, kernel, aligned))
    arrays_by_name = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                      "alibi_slopes": call.alibi_slopes, "seqused_k": seqused_k, "sinks": sinks,
                      **{f"mod_buffer{i}": x for i, x in enumerate(buffers)}}  # fmt: skip
    if call.dropout_p:
        arrays_by_name["dropout_seed"] = gpu_seed(lib, device, q, call.seed)
    return _launch.run(launch, lib, device, arrays_by_name, want_lse)


#: The operands of a paged packed call, in ``VarlenForward.names``' order (``_cascade`` too).
PAGED_NAMES = VarlenForward.names


def _gpu_paged_varlen(lib: _interop.ArrayLib, device: int, call: VarlenForward, want_lse: bool) -> tuple[Any, Any]:
    """attention_varlen over a paged cache: the FA2 kernel over the cache view (the plan looked up
    by the arguments as given, as ``gpu_varlen_forward``'s)."""
    named = call.arrays()
    q, k, v, cu_q, cu_k, _, _, table, _ = named
    key = (lib.name, device, q.shape, k.shape, v.shape, cu_q.shape, cu_k.shape, table.shape, _maxima(call),
           call.options, call.dropout_p, _dtypes(*named), _shapes(call.alibi_slopes, call.seqused_k, call.sinks),
           "paged")  # fmt: skip

    def plan() -> _plan.Launch:
        problem = _varlen_call_problem(call, table)
        dtypes = {n: None if x is None else lib.dtype_name(x) for n, x in zip(PAGED_NAMES, named)}
        _check_slopes_dtype(lib, call.alibi_slopes)
        _check_sinks_dtype(lib, call.sinks)
        return _plan.plan_paged_varlen(
            problem, dtypes, _device.device_info(device), tuple(q.shape), tuple(table.shape), k.shape[0]
        )

    launch = _plans.get(key, plan)
    return _launch.run(launch, lib, device, dict(zip(PAGED_NAMES, named)), want_lse)


# ---------------------------------------------------------------------------------------------
# Backward.
# ---------------------------------------------------------------------------------------------
def backward_problem(call: Backward) -> tuple[Problem, Any]:
    """A backward's problem (its gradients' shapes checked against q's) and its mask as 4-D."""
    problem, mask = with_mask(
        problem_of(call.q, call.k, call.v, call.options, call.layout, call.dropout_p, call.alibi_slopes, call.sinks),
        call.attn_mask,
    )
    lse_shape = (problem.batch, problem.heads_q, problem.seqlen_q)
    _check_shapes(call, (call.q.shape, call.q.shape, lse_shape, lse_shape))
    return problem, mask


def backward(call: Backward) -> tuple[Any, ...]:
    """``attention_backward`` where its arrays live: (dq, dk, dv), and dsinks with sinks. A training step's backward
    (CuPy arrays or CUDA tensors on one GPU, no mask, dropout or score function) whose arrays'
    shapes, dtypes and options were planned before goes straight to its launch: its checks were
    made then (``_lean_backward_key``)."""
    if call.dropout_p == 0 and call.attn_mask is None and call.mods is None:
        slopes, sinks = call.alibi_slopes, call.sinks
        lean = _interop.lean_arrays((call.q, call.k, call.v, call.dout, call.out, call.lse, call.dlse, slopes, sinks))
        if lean is not None:
            lib, device, _ = lean
            try:
                launch = _plans.find(_lean_backward_key(lib, device, call))
            except TypeError:  # a part that cannot be hashed: the general path refuses it
                launch = None
            if launch is not None:
                arrays_by_name = {"q": call.q, "k": call.k, "v": call.v, "out": call.out, "dout": call.dout,
                                  "lse": call.lse, "dlse": call.dlse, "alibi_slopes": slopes,
                                  "sinks": sinks}  # fmt: skip
                return _with_sink_gradient(_launch.run_outputs(launch, lib, device, arrays_by_name))
    problem, mask = backward_problem(call)
    if call.block_mask is not None:
        _check_block_mask(call.block_mask, problem)
    found = _interop.gpu_arrays(call.names, (*call.arrays()[:-2], mask, call.sinks))  # the mask as 4-D
    if found is None or call.captured_grads:
        # The kernels have no scatter of a captured array's gradient (an atomic add per score):
        # such a backward runs the array-API path where its arrays live, in larger steps on a GPU.
        dropout = Dropout(call.dropout_p, call.seed) if call.seed is not None else None
        score_mod, mask_mod = (None, None) if call.mods is None else call.mods
        return _host.attention_backward(
            call.dout, call.q, call.k, call.v, call.out, call.lse, call.dlse, problem, dropout, call.alibi_slopes, mask,
            score_mod, mask_mod, call.sinks, call.captured_grads, 64 if found is None else 256,
        )  # fmt: skip
    lib, device, arrays = found
    return gpu_backward(lib, device, call.on(arrays), problem)


def gpu_backward(
    lib: _interop.ArrayLib, device: int, call: Backward, problem: Problem, given: Any = _launch.EMPTY
) -> tuple[Any, ...]:
    """The kernels' backward on arrays the pipeline reads (``problem``: the call's, checked, its
    mask 4-D as ``call.attn_mask``): (dq, dk, dv), and dsinks with sinks. ``given``: output
    buffers to write, by name."""
    if call.mods is not None:
        bounds = _mask_as_bounds(call)
        if bounds is None:
            return _gpu_mods_backward(lib, device, call, problem, given)
        problem = with_implied_bounds(problem, call.mods[1])  # (the bounds' window: normalize_window)
        call = Backward(
            call.dout, call.q, call.k, call.v, call.out, call.lse, call.dlse, bounds, call.layout, call.deterministic,
            call.dropout_p, call.seed, call.alibi_slopes, call.attn_mask, None, call.sinks,
        )  # fmt: skip
    q, k, v, out, dout, lse, dlse, slopes, mask, sinks = (
        call.q, call.k, call.v, call.out, call.dout, call.lse, call.dlse, call.alibi_slopes, call.attn_mask, call.sinks
    )  # fmt: skip
    key = ("bwd", lib.name, device, problem, q.shape, k.shape,
           _dtypes(q, k, v, out, dout, lse, dlse, slopes, mask, sinks), call.deterministic)  # fmt: skip

    def plan() -> _plan.Launch:
        _check_slopes_dtype(lib, slopes)
        _check_sinks_dtype(lib, sinks)
        dtype = _backward_dtypes(lib, q, k, v, out, dout, lse, dlse)
        _check_mask_dtype(lib, problem, mask, dtype)
        return _plan.plan_backward(
            problem, dtype, _device.device_info(device), q_shape=tuple(q.shape), k_shape=tuple(k.shape),
            deterministic=call.deterministic,
        )  # fmt: skip

    launch = _plans.get(key, plan)
    if call.dropout_p == 0 and mask is None and not given:  # the next such call finds it by its arrays
        _plans.get(_lean_backward_key(lib, device, call), lambda: launch)
    arrays_by_name = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse,
                      "dropout_seed": call.seed, "alibi_slopes": slopes, "attn_mask": mask, "sinks": sinks}  # fmt: skip
    return _with_sink_gradient(_launch.run_outputs(launch, lib, device, arrays_by_name, given))


def _with_sink_gradient(grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """(dq, dk, dv), or with sinks (dq, dk, dv, dsinks): the rows' shares the backward's prep wrote
    (batches, Hq, rows) summed per head (the caller's library, on its stream)."""
    if len(grads) == 3:
        return grads
    dq, dk, dv, rows = grads
    return dq, dk, dv, rows.sum(axis=(0, 2))


def _gpu_mods_backward(
    lib: _interop.ArrayLib, device: int, call: Backward, problem: Problem, given: Any = _launch.EMPTY
) -> tuple[Any, ...]:
    """The backward of a call with a score_mod / mask_mod: the mma.sync kernels with the
    functions and score_mod's derivative compiled in (``_plan.plan_backward``'s ``mods``)."""
    mods_key, kernel, buffers = _kernel_mods_of(call, device)
    q, k, v, out, dout, lse, dlse, sinks = call.q, call.k, call.v, call.out, call.dout, call.lse, call.dlse, call.sinks
    block_mask = call.block_mask
    if block_mask is None and call.mods[1] is not None:  # the forward's (the same signature's)
        p = problem
        block_mask = _block_mask.implied_on(
            call.mods[1], p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, lib, device, kernel
        )
    cells = None if block_mask is None else _block_mask.layout(block_mask)  # (checked by the caller)
    key = ("bwd-mods", lib.name, device, problem, q.shape, k.shape, _dtypes(q, k, v, out, dout, lse, dlse, sinks),
           call.deterministic, mods_key, cells)  # fmt: skip

    def plan() -> _plan.Launch:
        _check_sinks_dtype(lib, sinks)
        return _plan.plan_backward(
            with_implied_bounds(problem, call.mods[1]), _backward_dtypes(lib, q, k, v, out, dout, lse, dlse),
            _device.device_info(device),
            q_shape=tuple(q.shape), k_shape=tuple(k.shape), deterministic=call.deterministic, mods=kernel,
            cells=cells,
        )  # fmt: skip

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse, "sinks": sinks,
                      **{f"mod_buffer{i}": x for i, x in enumerate(buffers)}}  # fmt: skip
    if block_mask is not None:
        arrays_by_name.update(_block_mask_buffers(block_mask, lib, device))
    return _with_sink_gradient(_launch.run_outputs(launch, lib, device, arrays_by_name, given))


def _lean_backward_key(lib: _interop.ArrayLib, device: int, call: Backward) -> tuple[Any, ...]:
    """A backward's plan by what its problem is made of (every array's shape and dtype, the
    options): a call with this key was checked when its plan was made, since the problem's checks
    read nothing else (no mask, no dropout here: those calls take the general path)."""
    q, k, v, out, dout, lse, dlse, slopes, sinks = (
        call.q, call.k, call.v, call.out, call.dout, call.lse, call.dlse, call.alibi_slopes, call.sinks
    )  # fmt: skip
    return ("bwd-lean", lib.name, device, q.shape, k.shape, v.shape, out.shape, dout.shape, lse.shape,
            None if dlse is None else dlse.shape, None if slopes is None else slopes.shape,
            None if sinks is None else sinks.shape, _dtypes(q, k, v, out, dout, lse, dlse, slopes, sinks),
            call.options, call.layout, call.deterministic)  # fmt: skip


def varlen_backward(call: VarlenBackward) -> tuple[Any, ...]:
    """``attention_varlen_backward`` where its arrays live: (dq, dk, dv), and dsinks with sinks."""
    problem = _varlen_call_problem(call)
    lse_shape = (problem.heads_q, call.q.shape[0])
    _check_shapes(call, (call.q.shape, call.q.shape, lse_shape, lse_shape))
    found = _interop.gpu_arrays(call.names, call.arrays())
    if found is None or call.captured_grads:
        # (captured arrays' gradients: the array-API path where the arrays live, as ``backward``'s)
        dropout = Dropout(call.dropout_p, call.seed) if call.seed is not None else None
        score_mod, mask_mod = (None, None) if call.mods is None else call.mods
        return _host.attention_varlen_backward(
            call.dout, call.q, call.k, call.v, call.out, call.lse, call.dlse, call.cu_seqlens_q, call.cu_seqlens_k,
            problem, dropout, call.alibi_slopes, call.seqused_k, call.sinks, score_mod, mask_mod,
            call.captured_grads, 64 if found is None else 256,
        )  # fmt: skip
    lib, device, arrays = found
    dout, q, k, v, out, lse, dlse, cu_q, cu_k, slopes, seqused_k, sinks = arrays
    kernel: _mods.KernelMods | None = None
    buffers: tuple[Any, ...] = ()
    mods_key = None
    if call.mods is not None and packed_rows_align(call):  # as the forward's: a mask that is a bound
        bounds = _exact_bounds(call.mods, call.options)
        if bounds is not None:
            return varlen_backward(dataclasses.replace(call, options=bounds, mods=None))
        problem = with_implied_bounds(problem, call.mods[1])
    if call.mods is not None:  # the functions in the packed backward's hook (as the forward's)
        mods_key, kernel, buffers = _kernel_mods_for(call.mods, q, None, device)
    key = ("bwd_varlen", lib.name, device, problem, q.shape, k.shape,
           _dtypes(q, k, v, out, dout, lse, dlse, cu_q, cu_k, slopes, seqused_k, sinks),
           call.deterministic, mods_key)  # fmt: skip

    def plan() -> _plan.Launch:
        dtype = _backward_dtypes(lib, q, k, v, out, dout, lse, dlse)
        _check_offset_dtypes(lib, cu_q, cu_k, seqused_k)
        _check_slopes_dtype(lib, slopes)
        _check_sinks_dtype(lib, sinks)
        return _plan.plan_backward(
            problem, dtype, _device.device_info(device), q_shape=tuple(q.shape), k_shape=tuple(k.shape),
            packed_rows=(q.shape[0], k.shape[0]), deterministic=call.deterministic, mods=kernel,
        )  # fmt: skip

    launch = _plans.get(key, plan)
    arrays_by_name = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse,
                      "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "dropout_seed": call.seed,
                      "alibi_slopes": slopes, "seqused_k": seqused_k, "sinks": sinks,
                      **{f"mod_buffer{i}": x for i, x in enumerate(buffers)}}  # fmt: skip
    return _with_sink_gradient(_launch.run_outputs(launch, lib, device, arrays_by_name))


# ---------------------------------------------------------------------------------------------
# Dropout's seed, and the dtype checks a plan makes once.
# ---------------------------------------------------------------------------------------------
def gpu_seed(lib: _interop.ArrayLib, device: int, x: Any, seed: int | None) -> int:
    """The seed of a GPU call with dropout: the caller's, or a fresh one (never under capture)."""
    if seed is not None:
        return seed
    if _interop.stream_is_capturing(lib.stream(device)):
        raise _interop.dropout_capture_error()
    return _interop.draw_seed(x)


def host_dropout(x: Any, dropout_p: float, seed: int | None) -> Dropout | None:
    if not dropout_p:
        return None
    return Dropout(dropout_p, _interop.draw_seed(x) if seed is None else seed)


def backward_dropout(dropout_p: Any, seed: Any) -> tuple[float, int | None]:
    """The forward's dropout, checked; its seed is required (the mask is regenerated from it)."""
    dropout_p, seed = check_dropout(dropout_p, seed)
    if dropout_p and seed is None:
        raise ValueError("a backward with dropout_p > 0 needs the forward's seed= (its mask is regenerated from it)")
    return dropout_p, seed if dropout_p else None


def _shapes(*arrays: Any) -> tuple[Any, ...]:
    """Every array's shape for a plan key (None for an absent optional array)."""
    return tuple(None if x is None else x.shape for x in arrays)


def _dtypes(*arrays: Any) -> tuple[Any, ...]:
    """Every array's dtype for a plan key (None for an absent optional array): a plan checks the
    dtypes once, so a call whose dtypes differ must not find it."""
    return tuple(None if x is None else x.dtype for x in arrays)


def _check_slopes_dtype(lib: _interop.ArrayLib, slopes: Any) -> None:
    if slopes is not None and lib.dtype_name(slopes) != "float32":
        raise TypeError(f"alibi_slopes must be float32 (as flash-attn's), got {lib.dtype_name(slopes)}")


def _check_sinks_dtype(lib: _interop.ArrayLib, sinks: Any) -> None:
    if sinks is not None and lib.dtype_name(sinks) != "float32":
        raise TypeError(
            f"sinks must be float32 on the GPU, got {lib.dtype_name(sinks)} (a cast keeps its gradient: sinks.float())"
        )


def _check_mask_dtype(lib: _interop.ArrayLib, problem: Problem, mask: Any, dtype: str) -> None:
    if problem.mask == "additive" and lib.dtype_name(mask) != dtype:
        raise TypeError(
            f"an additive attn_mask must have q's dtype {dtype} on the GPU (as SDPA's), got {lib.dtype_name(mask)}"
        )


def _check_offset_dtypes(lib: _interop.ArrayLib, cu_q: Any, cu_k: Any, seqused_k: Any) -> None:
    _plan.check_int32({"cu_seqlens_q": lib.dtype_name(cu_q), "cu_seqlens_k": lib.dtype_name(cu_k),
                       "seqused_k": None if seqused_k is None else lib.dtype_name(seqused_k)})  # fmt: skip


def _check_shapes(call: Backward | VarlenBackward, shapes: tuple[Any, ...]) -> None:
    """dout, out, lse and dlse (if given) against the shapes the forward gives them."""
    for name, x, shape in zip(("dout", "out", "lse", "dlse"), (call.dout, call.out, call.lse, call.dlse), shapes):
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
