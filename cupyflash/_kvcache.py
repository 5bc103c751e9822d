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
from typing import Any

from . import _device, _fp8, _host, _interop, _launch, _plan
from ._validate import (
    Options,
    check_alibi,
    check_num_splits,
    check_sinks,
    kvcache_problem,
    merge_problem,
)

_plans = _plan.new_cache()  # read by one call site, gpu_with_kvcache (PlanCache.recent)
_merge_plans = _plan.new_cache()
KV_NAMES = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new", "cache_batch_idx",
             "cache_leftpad", "alibi_slopes", "rotary_cos", "rotary_sin", "k_scale", "v_scale", "sinks",
             "tree_mask")  # fmt: skip
_kv_operands = operator.itemgetter(*KV_NAMES)


@dataclasses.dataclass(slots=True)
class CacheCall:
    """One ``attention_with_kvcache`` call, its options checked: its arrays by name (``KV_NAMES``;
    an int ``cache_seqlens``, and a float8 cache's scale as a host number, each value checked
    per call where it is used) as ``_launch.run`` reads them, the same in ``KV_NAMES``' order (the
    int and the host numbers as None) as the front door reads them, and its options. Not changed
    once built (``on`` and ``prepared`` make changed copies)."""

    named: dict[str, Any]
    operands: tuple[Any, ...]
    options: Options
    num_splits: int = 0
    rotary: bool | None = None  # interleaved or not, with rotary_cos / rotary_sin; None without
    kv_dtype: str | None = None
    batch_invariant: bool = False  # splits of a fixed size in keys (num_splits then 0)

    names = KV_NAMES

    def arrays(self) -> tuple[Any, ...]:
        return self.operands

    @property
    def writes(self) -> bool:
        """k_new / v_new are appended into the caches."""
        return self.named["k_new"] is not None

    @property
    def fp8(self) -> bool:
        """A float8 cache's options given (scales or the format)."""
        a = self.named
        return a["k_scale"] is not None or a["v_scale"] is not None or self.kv_dtype is not None

    def prepared(self) -> CacheCall:
        """ALiBi slopes that require grad refused, with their own message (after the torch.compile
        route: nothing Dynamo would trace)."""
        slopes = self.named["alibi_slopes"]
        if slopes is not None:
            _interop.refuse_slope_grad(slopes)
        return self

    def on(self, arrays: list[Any]) -> CacheCall:
        """The same call on ``arrays`` (``KV_NAMES``' order), as the pipeline reads them."""
        named = dict(zip(KV_NAMES, arrays))
        for name in ("cache_seqlens", "k_scale", "v_scale"):  # an int and host numbers, passed per call
            if named[name] is None:
                named[name] = self.named[name]
        return CacheCall(
            named, tuple(arrays), self.options, self.num_splits, self.rotary, self.kv_dtype, self.batch_invariant
        )


def cache_call(
    named: dict[str, Any], options: Options, num_splits: int = 0, rotary: bool | None = None,
    kv_dtype: str | None = None, batch_invariant: bool = False,
) -> CacheCall:  # fmt: skip
    """A ``CacheCall`` of arrays by name (every one of ``KV_NAMES``): the custom ops' and the JAX
    callbacks' way to make one."""
    operands = tuple(None if _per_call(n, x) else x for n, x in zip(KV_NAMES, _kv_operands(named)))
    return CacheCall(named, operands, options, num_splits, rotary, kv_dtype, batch_invariant)


def _per_call(name: str, x: Any) -> bool:
    """Is ``x`` a value passed per call (an int ``cache_seqlens``, a host number scale), no operand?"""
    if name == "cache_seqlens":
        return type(x) is int
    return name in ("k_scale", "v_scale") and x is not None and _fp8.is_host_number(x)


def _scales_checked(call: CacheCall) -> CacheCall:
    """The call with its host number scales as their checked float32 values (positive, finite):
    what the kernel takes per call."""
    named = call.named
    checked = {n: value for n in ("k_scale", "v_scale") if (value := _fp8.host_scale(n, named[n])) is not None}
    if not checked:
        return call
    return CacheCall(
        named | checked, call.operands, call.options, call.num_splits, call.rotary, call.kv_dtype,
        call.batch_invariant,
    )  # fmt: skip


def with_kvcache(call: CacheCall, want_lse: bool) -> tuple[Any, Any]:
    """A cache call where its arrays live: (out, lse), lse None on the GPU unless wanted (the
    custom op's and the JAX host callback's way in, past the front door's routing)."""
    found = _interop.gpu_arrays(KV_NAMES, call.operands)
    if found is None:
        return host_with_kvcache(call)
    lib, device, arrays = found
    return gpu_with_kvcache(lib, device, call.on(arrays), want_lse)


def host_with_kvcache(call: CacheCall) -> tuple[Any, Any]:
    """A cache call on host arrays: every value checked, then the array-API algorithms."""
    a = call.named
    seqlens = a["cache_seqlens"]
    cos, sin = a["rotary_cos"], a["rotary_sin"]
    p = kvcache_problem_of(
        a["q"], a["k_cache"], a["v_cache"], seqlens, a["block_table"], a["k_new"], a["v_new"], call.options,
        a["cache_batch_idx"], a["cache_leftpad"], a["alibi_slopes"], (cos, sin, call.rotary), a["sinks"],
        a["tree_mask"],
    )  # fmt: skip
    fp8 = _host_fp8(a["q"], a["k_cache"], a["v_cache"], a["k_new"], a["v_new"], call.kv_dtype, a["k_scale"],
                    a["v_scale"])  # fmt: skip
    return _host.attention_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], seqlens, a["block_table"], a["k_new"], a["v_new"], p,
        check_num_splits(call.num_splits), a["cache_batch_idx"], a["cache_leftpad"], a["alibi_slopes"], cos, sin,
        fp8=fp8, batch_invariant=call.batch_invariant, sinks=a["sinks"], tree_mask=a["tree_mask"],
    )  # fmt: skip


def gpu_with_kvcache(
    lib: _interop.ArrayLib, device: int, call: CacheCall, want_lse: bool, given: Any = _launch.EMPTY
) -> tuple[Any, Any]:
    """The kernels of a cache call on arrays the pipeline reads (the caches appended in place):
    (out, lse), lse None unless wanted. ``given``: output buffers to write, by name
    (``_launch.run``; XLA's under ``jax.jit``). A float8 cache's scales are arrays (operands) or
    host numbers (each value checked here and passed per call, as float32); ``kv_dtype`` names its
    format for caches of bytes (CuPy's uint8); ``batch_invariant``: splits of a fixed size in keys
    (checked against ``num_splits`` by the entry)."""
    named, kv_dtype = call.named, call.kv_dtype
    (q, k_cache, v_cache, seqlens, table, k_new, v_new, batch_idx, leftpad, slopes, cos, sin, k_scale, v_scale, sinks,
     tree) = _kv_operands(named)  # fmt: skip
    fp8_key = None  # a host scale keys as "host": its value (checked here) goes to the kernel per call
    if kv_dtype is not None or k_scale is not None or v_scale is not None:
        call = _scales_checked(call)
        named = call.named
        k_scale, v_scale = named["k_scale"], named["v_scale"]
        forms = ("host" if type(x) is float else None if x is None else (x.shape, x.dtype) for x in (k_scale, v_scale))
        fp8_key = (kv_dtype, *forms)
    # The signature, flat (a decode step builds it every call): what the plan depends on.
    key = (
        lib.name, device, call.options, call.num_splits, q.shape, q.dtype, k_cache.shape, k_cache.dtype,
        v_cache.shape, v_cache.dtype, None if type(seqlens) is int else (seqlens.shape, seqlens.dtype),
        None if table is None else (table.shape, table.dtype), None if k_new is None else (k_new.shape, k_new.dtype),
        None if v_new is None else v_new.shape, None if batch_idx is None else (batch_idx.shape, batch_idx.dtype),
        None if leftpad is None else (leftpad.shape, leftpad.dtype),
        None if slopes is None else (slopes.shape, slopes.dtype),
        None if cos is None else (cos.shape, cos.dtype, sin.shape, sin.dtype, call.rotary), fp8_key,
        call.batch_invariant, None if sinks is None else (sinks.shape, sinks.dtype),
        None if tree is None else (tree.shape, tree.dtype),
    )  # fmt: skip
    (key0, plan0), (key1, plan1) = _plans.recent
    if key == key0:
        launch = plan0
    elif key == key1:
        launch = plan1
    else:
        launch = _plans.lookup(key, _plan_kvcache, lib, device, call)
    return _launch.run(launch, lib, device, named, want_lse, given)


def kvcache_problem_of(
    q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any,
    options: Options, batch_idx: Any, leftpad: Any, slopes: Any = None,
    rotary: tuple[Any, Any, Any] = (None, None, None), sinks: Any = None, tree_mask: Any = None,
) -> Any:  # fmt: skip
    """A cache call's ``KvCacheProblem``; ``rotary``: (cos, sin, interleaved)."""

    def shape(x: Any) -> tuple[int, ...] | None:
        return None if x is None else tuple(x.shape)

    causal, scale, window, softcap = options.causal, options.scale, options.window, options.softcap
    kp = kvcache_problem(
        tuple(q.shape), tuple(k_cache.shape), tuple(v_cache.shape), cache_seqlens=seqlens,
        block_table_shape=shape(table), k_new_shape=shape(k_new), v_new_shape=shape(v_new), causal=causal,
        scale=scale, cache_batch_idx_shape=shape(batch_idx), cache_leftpad_shape=shape(leftpad), window=window,
        softcap=softcap, rotary_shapes=None if rotary[0] is None else (rotary[0].shape, rotary[1].shape),
        rotary_interleaved=rotary[2], tree_mask_shape=shape(tree_mask),
    )  # fmt: skip
    if slopes is None and sinks is None:
        return kp
    if kp.tree and slopes is not None:
        raise ValueError(
            "tree_mask does not take alibi_slopes (ALiBi's distance counts positions; a tree's drafts share theirs)"
        )
    alibi = check_alibi(slopes, kp.attn.batch, kp.attn.heads_q)
    has_sinks = check_sinks(sinks, kp.attn.heads_q)
    return dataclasses.replace(kp, attn=dataclasses.replace(kp.attn, alibi=alibi, sinks=has_sinks))


def _plan_kvcache(lib: _interop.ArrayLib, device: int, call: CacheCall) -> _plan.Launch:
    (q, k_cache, v_cache, seqlens, table, k_new, v_new, batch_idx, leftpad, slopes, cos, sin, k_scale, v_scale, sinks,
     tree) = _kv_operands(call.named)  # fmt: skip
    if lib.name == _interop.DLPACK and k_new is not None:  # checked once per plan: its key has lib.name
        namespace = getattr(lib, "namespace", None)
        raise TypeError(
            "attention_with_kvcache with k_new on the GPU takes CuPy arrays, PyTorch tensors or JAX arrays (the "
            f"cache is written in place), got {getattr(namespace, '__name__', 'other')} arrays"
        )
    # An int cache_seqlens is checked per call (the plan is shared by every int): plan with 0.
    p = kvcache_problem_of(
        q, k_cache, v_cache, 0 if type(seqlens) is int else seqlens, table, k_new, v_new, call.options, batch_idx,
        leftpad, slopes, (cos, sin, call.rotary), sinks, tree,
    )  # fmt: skip
    named = {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
        "cache_seqlens": None if type(seqlens) is int else seqlens, "block_table": table,
        "cache_batch_idx": batch_idx, "cache_leftpad": leftpad, "rotary_cos": cos, "rotary_sin": sin,
        "tree_mask": tree,
    }  # fmt: skip
    dtypes: dict[str, str | None] = {n: None if x is None else lib.dtype_name(x) for n, x in named.items()}
    if slopes is not None and lib.dtype_name(slopes) != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {lib.dtype_name(slopes)}")
    if sinks is not None and lib.dtype_name(sinks) != "float32":
        raise TypeError(f"sinks must be float32 on the GPU, got {lib.dtype_name(sinks)}")
    fp8 = _gpu_fp8(lib, dtypes, p.attn.heads_kv, call.kv_dtype, k_scale, v_scale)
    return _plan.plan_kvcache(
        p, dtypes, _device.device_info(device), num_splits=check_num_splits(call.num_splits), fp8=fp8,
        batch_invariant=call.batch_invariant,
    )  # fmt: skip


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


# The bits of the device error word (kernels_cu/params.cuh: kBadPage ... kBadRotaryPosition).
_DEVICE_ERRORS = {
    1: "a block_table entry in use was outside [0, num_pages) (or a prefix_block_table entry)",
    2: "a cache_seqlens value was outside [0, capacity - seqlen_new], a cache_leftpad value outside "
    "[0, cache_seqlens], a packed sequence's key count (cu_seqlens_k over pages) beyond its block_table row, "
    "a prefix_seqlens value outside [0, the keys of its prefix_block_table row], or a packed sequence with more keys "
    "than max_seqlen_k in attention_varlen_backward",
    4: "a cache_batch_idx value was outside the cache's entries",
    8: "a cu_seqlens_q value was negative, decreasing or past the packed total (or cu_seqlens_q[0] was not 0)",
    16: "a cu_seqlens_k value was negative, decreasing or past the packed total (or cu_seqlens_k[0] was not 0)",
    32: "a seqused_k value was outside [0, its sequence's key count]",
    64: "a cache_batch_idx value named an entry that another sequence also names while k_new appends into it",
    128: "a cache_seqlens value put a rotated key or query past rotary_cos's positions",
}


def check_device_errors(device: int | None = None) -> None:
    """Raise :class:`DeviceValueError` if a kernel on ``device`` (default: the current one) met
    an out-of-range device-side value since the last check: of ``attention_with_kvcache``
    (``cache_seqlens``, ``block_table``, ``cache_batch_idx``, ``cache_leftpad``), or of
    ``attention_varlen`` and ``attention_varlen_backward`` (``cu_seqlens_q`` / ``cu_seqlens_k``
    offsets that are negative, decreasing, past the packed total or not starting at 0, a
    ``seqused_k`` outside ``[0, key count]``; over pages: ``block_table``, a key count beyond its
    table row; on Hopper's backward, a sequence with more keys than ``max_seqlen_k``, whose keys
    past it keep dK = dV = 0 and give dQ nothing). The message names each kind of value met.

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
