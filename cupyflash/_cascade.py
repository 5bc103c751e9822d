"""Shared-prefix (cascade) decoding: ``attention_with_shared_prefix``.

Requests that share a long prefix (a system prompt, parallel sampling, beams) attend to its keys
once per group instead of once per request. Each request's keys are split in two -- its group's
prefix, then its own suffix -- and the two attentions merged exactly by their LSE (softmax over a
union of disjoint key sets).

On the GPU that is one launch of the split-KV decode kernel's cascade variant (kernels_cu/
decode.cu, ``Is_cascade``), after the append of ``k_new`` / ``v_new``: the prefixes' CTAs take a
row block of a group's requests (query heads of a KV head packed as rows, GQA) against a split of
the group's prefix pages, read once for all those rows; the requests' CTAs take splits of their
own pages; every CTA writes fp32 partials, and whichever CTA draws a request's last ticket merges
its own and its prefix's parts (``gpu_shared_prefix``). On Hopper, where a group holds 64 packed
rows or more, the prefixes' CTAs take 128 rows by wgmma (``DecodeSpec.wgmma_prefix``). Where a
request's packed rows do not fit one decode tile (more than DECODE_MAX_QUERIES query tokens, or
query tokens x the GQA group past the head dim's largest tile: 32 rows at d = 128, 16 at d = 256),
the call runs as a composition of library calls instead (``_composed``: the suffix's cache call,
the prefix as a paged varlen call over GQA-packed rows, and merges). On the host, the array-API
twin of the kernel's steps (``host_shared_prefix``).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _attention, _device, _dispatch, _front, _interop, _kvcache, _launch, _plan
from ._api import attention_with_kvcache
from ._kvcache import merge_states
from ._specs import DECODE_MAX_QUERIES
from ._validate import NO_WINDOW, Options, check_num_splits, check_options

# Splits of the prefix's keys in the composition: enough CTAs for two waves of the GPU, each split
# at least this many keys (a split's fixed cost, its partial state and a merge, is then below its
# read time).
_MIN_SPLIT_KEYS = 2048
_MAX_SPLITS = 32

#: The arrays of a call, in its ``arrays()`` order (``prefix_rows``: the kernel's row blocks, made
#: by the GPU executor).
NAMES = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new", "prefix_block_table",
         "prefix_seqlens")  # fmt: skip
_named_arrays = operator.itemgetter(*NAMES)


@dataclasses.dataclass(slots=True)
class SharedPrefixCall:
    """One ``attention_with_shared_prefix`` call, its options checked: its arrays by name
    (``NAMES``; an int ``cache_seqlens``, and ``prefix_seqlens`` as an int or a tuple of host ints,
    passed per call) and the same in ``NAMES``' order (those as None), as the front door reads
    them; ``groups``: the G + 1 offsets of the prefixes' groups (host ints)."""

    named: dict[str, Any]
    operands: tuple[Any, ...]
    options: Options
    groups: tuple[int, ...]
    num_splits: int

    names = NAMES

    def arrays(self) -> tuple[Any, ...]:
        return self.operands

    @property
    def writes(self) -> bool:
        return self.named["k_new"] is not None

    def prepared(self) -> SharedPrefixCall:
        return self

    def on(self, arrays: list[Any]) -> SharedPrefixCall:
        named = dict(zip(NAMES, arrays))
        for name in ("cache_seqlens", "prefix_seqlens"):  # host values, passed per call
            if named[name] is None:
                named[name] = self.named[name]
        return SharedPrefixCall(named, tuple(arrays), self.options, self.groups, self.num_splits)


def attention_with_shared_prefix(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    prefix_block_table: Any,
    prefix_seqlens: Any,
    block_table: Any,
    cache_seqlens: Any,
    k_new: Any = None,
    v_new: Any = None,
    prefix_groups: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    softcap: float = 0.0,
    num_splits: int = 0,
    return_lse: bool = False,
) -> Any:
    """Decoding over a two-level paged KV cache (FlashInfer's cascade): each request's keys are its
    group's shared prefix followed by its own suffix, both in pages of one pool.

    Parameters
    ----------
    q : array ``(B, Nq, Hq, d)``, as for :func:`attention_with_kvcache` (on the GPU float16 or
        bfloat16, d a multiple of 32 up to 256)
    k_cache, v_cache : paged caches ``(num_pages, page_size, Hkv, d)``: the pool holding both the
        prefixes' pages and the requests' own pages
    prefix_block_table : int32 array ``(G, max_prefix_pages)``
        The pages of each group's shared prefix (key ``j`` of prefix ``g`` is slot
        ``j % page_size`` of page ``prefix_block_table[g, j // page_size]``).
    prefix_seqlens : int, or int32 array ``(G,)``
        The keys of each prefix.
    block_table : int32 array ``(B, max_pages)``; cache_seqlens : int or int32 array ``(B,)``
        Each request's own pages and the tokens already in them (its keys after its prefix), as
        :func:`attention_with_kvcache` takes them.
    k_new, v_new : arrays ``(B, Nnew, Hkv, d)``, optional
        Appended to each request's own pages first (as :func:`attention_with_kvcache`).
    prefix_groups : sequence of ``G + 1`` ints, optional
        Requests ``prefix_groups[g] .. prefix_groups[g + 1] - 1`` share prefix ``g`` (host ints:
        scheduling metadata, sorted by group). Default: one group of all ``B`` requests.
    causal : bool
        Bottom-right aligned over the prefix and the suffix together, as if the request's keys were
        one sequence. The prefix is then visible to every query as long as each request's own keys
        (after the append) number at least ``Nq - 1``: always with ``k_new`` of ``Nnew >= Nq - 1``
        tokens or one query token; otherwise ``cache_seqlens`` must be host values that show it.
    scale, softcap, num_splits, return_lse : as for :func:`attention_with_kvcache`
        (``num_splits`` is the suffix's; the prefix's split follows from its length and the GPU).

    Returns
    -------
    out, or (out, lse): as :func:`attention_with_kvcache` over each request's whole key sequence,
    equal to the flat paged call up to the rounding of the two partial outputs to q's dtype.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> pool = rng.standard_normal((6, 4, 1, 8)).astype(np.float32)  # 6 pages of 4 keys
    >>> q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    >>> prefix = np.array([[0, 1]], dtype=np.int32)  # both requests share 8 keys on pages 0, 1
    >>> own = np.array([[2], [3]], dtype=np.int32)  # then 3 and 1 keys of their own
    >>> seqlens = np.array([3, 1], dtype=np.int32)
    >>> out = cupyflash.attention_with_shared_prefix(q, pool, pool, prefix_block_table=prefix, prefix_seqlens=8,
    ...                                              block_table=own, cache_seqlens=seqlens)
    >>> flat = np.array([[0, 1, 2], [0, 1, 3]], dtype=np.int32)
    >>> want = cupyflash.attention_with_kvcache(q, pool, pool, cache_seqlens=seqlens + 8, block_table=flat)
    >>> bool(np.allclose(out, want, atol=1e-5))
    True
    """
    q_shape, cache_shape, table_shape = q.shape, k_cache.shape, prefix_block_table.shape
    if len(q_shape) != 4 or len(cache_shape) != 4 or len(table_shape) != 2:
        _refuse_ranks(q_shape, cache_shape, table_shape)
    b, nq, hq, _ = q_shape
    _, page_size, hkv, _ = cache_shape
    num_groups, prefix_pages = table_shape
    groups = (0, b) if prefix_groups is None and num_groups == 1 else _check_groups(prefix_groups, num_groups, b)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq = {hq} must be a multiple of Hkv = {hkv}")
    if causal and nq > 1 and (k_new is None or int(k_new.shape[1]) < nq - 1):
        _check_suffix_covers_queries(cache_seqlens, nq)
    options = check_options(causal, scale, NO_WINDOW, softcap)
    if type(num_splits) is not int:
        num_splits = check_num_splits(num_splits)
    # Host lengths (an int, NumPy values) are read and checked here, before any append; an array
    # is an operand (on the GPU checked by the kernel).
    lengths = prefix_seqlens
    if type(lengths) is not int or not 0 <= lengths <= prefix_pages * page_size:
        lengths = _host_lengths(prefix_seqlens, num_groups, prefix_pages * page_size)
    named = {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens, "block_table": block_table,
        "k_new": k_new, "v_new": v_new, "prefix_block_table": prefix_block_table, "prefix_seqlens": lengths,
    }  # fmt: skip
    operands = (q, k_cache, v_cache, None if type(cache_seqlens) is int else cache_seqlens, block_table, k_new, v_new,
                prefix_block_table, None if isinstance(lengths, (int, tuple)) else lengths)  # fmt: skip
    call = SharedPrefixCall(named, operands, options, groups, num_splits)
    out, lse = _front.route(_SHARED_PREFIX, call, return_lse)[:2]
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The GPU: one launch of the decode kernel's cascade variant (after the append).
# ---------------------------------------------------------------------------------------------
# Per call signature: (the Launch, the device arrays of its "prefix_rows" and of host prefix
# lengths), or () where the call runs as the composition. The row blocks are made once per
# signature: a host-to-device copy from pageable memory waits for the stream, so one per call
# would be a synchronisation per decode step.
_routes = _plan.new_route_cache()


def gpu_shared_prefix(lib: _interop.ArrayLib, device: int, call: SharedPrefixCall, want_lse: bool) -> tuple[Any, Any]:
    """A call on arrays the pipeline reads: one launch where it fits (``_route``), else
    ``_composed``; (out, lse), lse None unless wanted."""
    q, k_cache, v_cache, seqlens, table, k_new, v_new, prefix_table, lengths = _named_arrays(call.named)
    key = (
        lib.name, device, call.options, call.num_splits, call.groups, q.shape, q.dtype, k_cache.shape, k_cache.dtype,
        v_cache.shape, v_cache.dtype, None if type(seqlens) is int else (seqlens.shape, seqlens.dtype),
        (table.shape, table.dtype), None if k_new is None else (k_new.shape, k_new.dtype),
        None if v_new is None else (v_new.shape, v_new.dtype), (prefix_table.shape, prefix_table.dtype),
        # an int goes to the kernel per call (one plan for every value); host values, on the device
        None if type(lengths) is int else lengths if type(lengths) is tuple else (lengths.shape, lengths.dtype),
    )  # fmt: skip
    (key0, route0), (key1, route1) = _routes.recent  # a decode step's signature: compared, not hashed
    if key == key0:
        route = route0
    elif key == key1:
        route = route1
    else:
        route = _routes.lookup(key, _route, lib, device, call)
    if not route:
        return _composed(call)
    launch, rows, host_lengths = route
    arrays = {**call.named, "prefix_rows": rows}
    if host_lengths is not None:
        arrays["prefix_seqlens"] = host_lengths
    return _launch.run(launch, lib, device, arrays, want_lse)


def _route(lib: _interop.ArrayLib, device: int, call: SharedPrefixCall) -> tuple[Any, ...]:
    """The call's one-launch plan and the device arrays it reads, or () for the composition (a
    request's packed rows past one decode tile: ``one_launch``; () and not None, which the
    cache would take for a miss and plan again every call)."""
    q, k_cache, v_cache, seqlens, table, k_new, v_new, prefix_table, lengths = _named_arrays(call.named)
    if lib.name == _interop.DLPACK and k_new is not None:  # as the cache call
        namespace = getattr(lib, "namespace", None)
        raise TypeError(
            "attention_with_shared_prefix with k_new on the GPU takes CuPy arrays, PyTorch tensors or JAX arrays (the "
            f"cache is written in place), got {getattr(namespace, '__name__', 'other')} arrays"
        )
    kp = _kvcache.kvcache_problem_of(
        q, k_cache, v_cache, 0 if type(seqlens) is int else seqlens, table, k_new, v_new, call.options, None, None
    )
    if not one_launch(kp.attn.seqlen_q, kp.attn.heads_q // max(kp.attn.heads_kv, 1), kp.attn.head_dim):
        return ()
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
             "cache_seqlens": None if type(seqlens) is int else seqlens, "block_table": table}  # fmt: skip
    dtypes = {n: None if x is None else lib.dtype_name(x) for n, x in named.items()}
    _plan.check_int32({
        "prefix_block_table": lib.dtype_name(prefix_table),
        "prefix_seqlens": None if isinstance(lengths, (int, tuple)) else lib.dtype_name(lengths),
    })  # fmt: skip
    launch = _plan.plan_kvcache(
        kp, dtypes, _device.device_info(device), num_splits=call.num_splits,
        cascade=_plan.CascadePrefix(call.groups, int(prefix_table.shape[1])),
    )  # fmt: skip
    rows = device_ints(q, _plan.cascade_blocks(launch, call.groups) or [(0, 0, 0)])
    return launch, rows, device_ints(q, lengths) if isinstance(lengths, tuple) else None


def device_ints(like: Any, values: Sequence[Any]) -> Any:
    """Host ints as an int32 array on ``like``'s device, in its library (made once per call
    signature: the copy waits for the stream)."""
    from array_api_compat import array_namespace
    from array_api_compat import device as device_of

    xp = array_namespace(like)
    return xp.asarray(values, dtype=xp.int32, device=device_of(like))


def one_launch(seqlen_q: int, group: int, head_dim: int) -> bool:
    """Whether the GPU runs a call in one launch: at most DECODE_MAX_QUERIES query tokens whose
    packed rows (x the GQA ``group``) fit one decode tile of ``head_dim`` (``cascade_tiles``)."""
    return seqlen_q <= DECODE_MAX_QUERIES and bool(_dispatch.cascade_tiles(head_dim, seqlen_q * group))


# ---------------------------------------------------------------------------------------------
# The host: the kernel's steps in the array-API standard (the GPU's order, side by side).
# ---------------------------------------------------------------------------------------------
def host_shared_prefix(call: SharedPrefixCall) -> tuple[Any, Any]:
    """The cascade kernel's steps on host arrays, every value checked before anything is written
    (the prefixes' by ``_host_prefix_layout``, the requests' by the cache call):

    1. decode_append, then each request's CTAs over its own keys: the cache call's host twin,
       (O_s, LSE_s) per row;
    2. each prefix's CTAs: the rows of every request of its group (tokens x query heads), one
       attention over the prefix's keys, all visible (``_host_prefix``): (O_p, LSE_p) per row;
    3. the last ticket's merge_row: the two states of each row merged by their LSE.
    """
    from . import _host, xp_impl

    a = call.named
    xp = _host.namespace(
        ("q", "k_cache", "v_cache", "prefix_block_table"), (a["q"], a["k_cache"], a["v_cache"], a["prefix_block_table"])
    )  # fmt: skip
    layout, lengths = _host_prefix_layout(call)
    suffix = {n: a.get(n) for n in _kvcache.KV_NAMES}
    out_s, lse_s = _kvcache.host_with_kvcache(_kvcache.cache_call(suffix, call.options, call.num_splits))
    prefix_out, prefix_lse = _host_prefix(xp, call, layout, lengths)
    return xp_impl.merge_states(xp, prefix_out, prefix_lse, out_s, lse_s)


def _host_prefix_layout(call: SharedPrefixCall) -> tuple[Any, tuple[int, ...]]:
    """The prefixes' pages (an ``xp_impl.CacheLayout``) and lengths, each length within its table
    row and each page in use within the pool (the kernel's prefix_span and page checks, raised)."""
    from . import _host, xp_impl

    a = call.named
    table, lengths = a["prefix_block_table"], a["prefix_seqlens"]
    num_pages, page_size = (int(n) for n in a["k_cache"].shape[:2])
    pages = _host.host_ints(table)
    if isinstance(lengths, int):
        lengths = (lengths,) * len(pages)
    elif not isinstance(lengths, tuple):
        lengths = tuple(_host.host_ints(lengths))
    capacity = int(table.shape[1]) * page_size
    for g, n in enumerate(lengths):
        bad = [p for p in pages[g][: -(-n // page_size)] if not 0 <= p < num_pages] if 0 <= n <= capacity else None
        if bad is None or bad:
            why = f"{n} keys, outside [0, {capacity}]" if bad is None else f"pages {bad} outside [0, {num_pages})"
            raise ValueError(f"prefix {g}: {why}")
    return xp_impl.CacheLayout(pages, page_size), lengths


def _host_prefix(xp: Any, call: SharedPrefixCall, layout: Any, lengths: tuple[int, ...]) -> tuple[Any, Any]:
    """Step 2 of ``host_shared_prefix``: for each group g, its requests' queries as one sequence of
    n_g x Nq tokens against prefix g's keys (non-causal: every row sees the whole prefix), split
    into ``_host_prefix_splits`` key ranges merged by LSE as the kernel's prefix splits are;
    (out (B, Nq, Hq, d), LSE (B, Hq, Nq))."""
    from . import xp_impl
    from ._validate import attention_problem

    a = call.named
    q, k_cache, v_cache = a["q"], a["k_cache"], a["v_cache"]
    b, nq, hq, d = (int(n) for n in q.shape)
    outs, lses = [], []
    for g, (begin, end) in enumerate(zip(call.groups, call.groups[1:])):
        if begin == end:
            continue
        rows = xp.reshape(q[begin:end, ...], (1, (end - begin) * nq, hq, d))  # the group's rows, one sequence
        keys = [xp.expand_dims(layout.gather(xp, c, g, lengths[g]), axis=0) for c in (k_cache, v_cache)]
        p = attention_problem(
            tuple(rows.shape), tuple(keys[0].shape), tuple(keys[1].shape), causal=False, scale=call.options.scale,
            window=(-1, -1), softcap=call.options.softcap, layout="bshd",
        )  # fmt: skip
        split_keys = -(-max(lengths[g], 1) // _host_prefix_splits(lengths[g]))
        out, lse = xp_impl.attention(xp, rows, keys[0], keys[1], p, algorithm="decode", split_keys=split_keys)
        outs.append(xp.reshape(out, (end - begin, nq, hq, d)))
        lses.append(xp.permute_dims(xp.reshape(lse, (hq, end - begin, nq)), (1, 0, 2)))
    if not outs:  # an empty batch: the cache call's empty state
        return q, xp.zeros((0, hq, nq), dtype=xp_impl.compute_dtype(xp, q))
    return xp.concat(outs, axis=0), xp.concat(lses, axis=0)


def _host_prefix_splits(prefix_keys: int) -> int:
    """Key ranges of a prefix on the host: one (the tests set more, to check the merge of splits)."""
    return 1


_SHARED_PREFIX = _front.Operation("attention_with_shared_prefix", host_shared_prefix, gpu_shared_prefix)


# ---------------------------------------------------------------------------------------------
# The composition, where one launch cannot take a call (``one_launch``): public calls on the GPU.
# ---------------------------------------------------------------------------------------------
def _composed(call: SharedPrefixCall) -> tuple[Any, Any]:
    """The suffix's cache call (with the append), the prefix as one paged ``attention_varlen`` over
    the GQA-packed rows of each group split into key ranges (the FA2 kernel over the cache view),
    the merge of the prefix's ranges, and ``merge_states`` of the two; on the GPU's arrays."""
    from array_api_compat import array_namespace
    from array_api_compat import device as device_of

    a = call.named
    q, k_cache, v_cache, prefix_block_table = a["q"], a["k_cache"], a["v_cache"], a["prefix_block_table"]
    lengths = a["prefix_seqlens"]
    b, nq, hq, d = (int(n) for n in q.shape)
    page_size, hkv = int(k_cache.shape[1]), int(k_cache.shape[2])
    num_groups, prefix_pages = (int(n) for n in prefix_block_table.shape)
    groups, options = call.groups, call.options
    scale, softcap = options.scale, options.softcap
    host_lens = (lengths,) * num_groups if isinstance(lengths, int) else lengths if isinstance(lengths, tuple) else None
    xp = array_namespace(q)
    where = device_of(q)
    # (library, device, ...): the prefix table in q's library and device
    gpu = _interop.gpu_arrays(("q", "prefix_block_table"), (q, prefix_block_table))
    assert gpu is not None  # (the host runs host_shared_prefix)
    lib, device = gpu[0], gpu[1]

    # The suffix first: its append must land before anything reads the pages (no other read of
    # those pages follows, but a caller may pass the same pool as prefix and suffix).
    out_s, lse_s = attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=a["cache_seqlens"], block_table=a["block_table"], k_new=a["k_new"],
        v_new=a["v_new"], causal=options.causal, scale=scale, softcap=softcap, num_splits=call.num_splits,
        return_lse=True,
    )  # fmt: skip

    # The prefix: S key ranges of `chunk` pages each; pseudo-sequence (s, g) is group g's queries
    # against range s of prefix g. One query token: GQA-packed rows (row t * group + j is request t
    # at head hkv * group + j, so a CTA's K/V tiles serve the whole group of heads); several: the
    # query heads as they are. The packed rows run s-major: part s of the output is the batch.
    group = hq // hkv
    packed = nq == 1
    heads, rows_per_query = (hkv, group) if packed else (hq, 1)
    t = b * nq
    rows = t * rows_per_query
    splits = _prefix_splits(device, prefix_pages * page_size, heads, rows)
    chunk = -(-prefix_pages // splits) if prefix_pages else 1
    splits = max(-(-prefix_pages // chunk), 1)
    chunk_keys = chunk * page_size
    table = _split_table(xp, where, prefix_block_table, splits, chunk)
    group_rows = tuple((groups[g + 1] - groups[g]) * nq * rows_per_query for g in range(num_groups))
    cu_q, cu_k = _offsets(xp, where, group_rows, splits, chunk_keys, lengths, host_lens)
    if packed:
        q_rows = xp.reshape(xp.permute_dims(xp.reshape(q, (t, hkv, group, d)), (0, 2, 1, 3)), (rows, hkv, d))
    else:
        q_rows = xp.reshape(q, (rows, hq, d))
    if splits > 1:
        q_rows = xp.reshape(xp.broadcast_to(q_rows[None], (splits, rows, heads, d)), (splits * rows, heads, d))
    prefix_args = (q_rows, k_cache, v_cache, cu_q, cu_k, max(group_rows, default=0), chunk_keys, scale, softcap, table)
    out_p, lse_p = _gpu_prefix(lib, device, *prefix_args)
    prefix_out, prefix_lse = _gpu_merge_prefix(lib, device, out_p, lse_p, splits, (b, nq, hq, hkv, d), packed)
    return merge_states(prefix_out, prefix_lse, out_s, lse_s)


def _split_table(xp: Any, where: Any, table: Any, splits: int, chunk: int) -> Any:
    """The block table of the pseudo-sequences: row s * G + g is pages s * chunk .. of prefix g
    (zeros past the prefix's pages: never read, no key there)."""
    num_groups, pages = (int(n) for n in table.shape)
    pad = splits * chunk - pages
    if pad:
        table = xp.concat([table, xp.zeros((num_groups, pad), dtype=table.dtype, device=where)], axis=1)
    if num_groups == 1:  # a view: no copy
        return xp.reshape(table, (splits, chunk))
    return xp.reshape(xp.permute_dims(xp.reshape(table, (num_groups, splits, chunk)), (1, 0, 2)), (-1, chunk))


# Offsets built from host values, kept on their device: a call builds them once (a host-to-device
# copy from pageable memory waits for the stream: every call would be a synchronisation).
_OFFSETS: dict[Any, Any] = {}


def _offsets(
    xp: Any, where: Any, group_rows: tuple[int, ...], splits: int, chunk_keys: int, prefix_seqlens: Any,
    host_lens: tuple[int, ...] | None,
) -> tuple[Any, Any]:  # fmt: skip
    """cu_seqlens_q and cu_seqlens_k of the pseudo-sequences (s-major, g inner): group g's rows,
    and the keys of range s of prefix g, len_g - s chunk_keys cut to [0, chunk_keys] except at the
    ends: the first range keeps a negative length and the last one the keys past the table, so
    that the kernel flags a bad device length instead of reading a plausible part of it."""
    key = (xp.__name__, str(where), group_rows, splits, chunk_keys, host_lens)
    hit = _OFFSETS.get(key)
    if hit is not None:
        return hit
    int32 = xp.int32
    cu_q = xp.asarray([0, *itertools.accumulate(group_rows * splits)], dtype=int32, device=where)
    if host_lens is None:  # lengths on the device: counts computed there, every call
        lens = xp.reshape(xp.asarray(prefix_seqlens, dtype=int32, device=where), (1, -1))
        starts = xp.reshape(xp.arange(splits, dtype=int32, device=where) * chunk_keys, (splits, 1))
        counts = lens - starts
        counts = xp.where(starts > 0, xp.maximum(counts, 0), counts)
        counts = xp.where(starts < (splits - 1) * chunk_keys, xp.minimum(counts, chunk_keys), counts)
        zero = xp.zeros((1,), dtype=int32, device=where)
        return cu_q, xp.astype(xp.concat([zero, xp.cumulative_sum(xp.reshape(counts, (-1,)))]), int32)
    counts = [min(max(n - s * chunk_keys, 0), chunk_keys) for s in range(splits) for n in host_lens]
    cu_k = xp.asarray([0, *itertools.accumulate(counts)], dtype=int32, device=where)
    if len(_OFFSETS) >= 256:
        _OFFSETS.clear()
    _OFFSETS[key] = cu_q, cu_k
    return cu_q, cu_k


def _host_lengths(x: Any, count: int, capacity: int) -> Any:
    """The prefix lengths as a call passes them on: an int (every prefix's, or NumPy values that
    are all equal) or a tuple of ``count`` ints, each checked within the prefix table's
    ``capacity`` keys; any other array as it is (checked for its shape here, for its values by the
    kernel, or by the host path)."""
    if type(x) is int:
        values: tuple[int, ...] = (x,)
    elif isinstance(x, (np.ndarray, list, tuple)):
        values = tuple(int(n) for n in np.asarray(x).reshape(-1))
        if len(values) != count:
            raise ValueError(f"prefix_seqlens must have one entry per prefix ({count}), got {len(values)}")
    else:
        if tuple(x.shape) != (count,):
            raise ValueError(f"prefix_seqlens must be ({count},), one length per prefix, got shape {tuple(x.shape)}")
        return x
    bad = [n for n in values if not 0 <= n <= capacity]
    if bad:
        raise ValueError(f"prefix_seqlens {bad} outside [0, {capacity}] (the keys prefix_block_table's pages hold)")
    if len(set(values)) <= 1:  # one length for every prefix: an int the kernel takes per call
        return values[0] if values else 0
    return values


_parts_plans = _plan.new_cache()


def parts_layout(splits: int, dims: tuple[int, int, int, int, int], packed: bool) -> _plan.PartsLayout:
    """Where the merge kernel finds the prefix's S states in the varlen kernel's output (rows of
    part s first; out (S rows, heads, d), LSE (heads, S rows)) and writes (B, Nq, Hq, d) and
    (B, Hq, Nq). ``dims``: (B, Nq, Hq, Hkv, d)."""
    b, nq, hq, hkv, d = dims
    t, group = b * nq, hq // hkv
    if packed:  # index space (hkv, j, t): packed row t * group + j of head hkv is out head hkv * group + j
        return _plan.PartsLayout(
            (hkv, group, t, d), splits, (t * group * hkv * d, d, hkv * d, group * hkv * d),
            (t * group, splits * t * group, group), (b, nq, hq, d), (group * d, d, hq * d), (b, hq, nq), (group, hq),
        )  # fmt: skip
    # index space (b, i, h): row b * nq + i of every part
    return _plan.PartsLayout(
        (b, nq, hq, d), splits, (t * hq * d, nq * hq * d, hq * d, d), (t, nq, splits * t), (b, nq, hq, d),
        (nq * hq * d, hq * d, d), (b, hq, nq), (hq * nq, nq),
    )  # fmt: skip


def _gpu_merge_prefix(
    lib: Any, device: int, out_p: Any, lse_p: Any, splits: int, dims: tuple[int, int, int, int, int], packed: bool
) -> tuple[Any, Any]:
    """The S key ranges' states of the prefix merged by LSE into (B, Nq, Hq, d) and (B, Hq, Nq) in
    one launch of the split-KV merge, reading the varlen kernel's packed output in place
    (``parts_layout``)."""
    from . import _launch

    layout = parts_layout(splits, dims, packed)
    dtype = lib.dtype_name(out_p)
    launch = _parts_plans.get((lib.name, device, layout, dtype), lambda: _plan.plan_merge_parts(layout, dtype))
    return _launch.run(launch, lib, device, {"o_parts": out_p, "lse_parts": lse_p}, True)


_prefix_plans = _plan.new_cache()


def _gpu_prefix(
    lib: Any, device: int, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, scale: Any,
    softcap: float, table: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """The prefix's paged varlen call on the GPU, its plan cached by the call's signature: the
    public call's checks and planning run once per shape (a decode step is host-bound here)."""
    from . import _launch

    named = dict(zip(_attention.PAGED_NAMES, (q, k, v, cu_q, cu_k, None, None, table, None), strict=True))
    dtypes = tuple(None if x is None else lib.dtype_name(x) for x in named.values())
    key = (lib.name, device, q.shape, k.shape, table.shape, cu_q.shape, dtypes, max_q, max_k, scale, softcap)

    def plan() -> _plan.Launch:  # the public call's checks (shapes, options, dtypes), without its launch
        problem = _attention.varlen_problem_of(
            q, k, v, cu_q, cu_k, max_q, max_k, check_options(False, scale, NO_WINDOW, softcap), block_table=table
        )
        return _plan.plan_paged_varlen(
            problem, dict(zip(named, dtypes)), _device.device_info(device), tuple(q.shape), tuple(table.shape),
            k.shape[0],
        )  # fmt: skip

    launch = _prefix_plans.get(key, plan)
    return _launch.run(launch, lib, device, named, True)


def _refuse_ranks(q_shape: Any, cache_shape: Any, table_shape: Any) -> None:
    if len(q_shape) != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, heads, head_dim), got shape {tuple(q_shape)}")
    if len(cache_shape) != 4:
        raise ValueError(f"k_cache must be paged (num_pages, page_size, Hkv, d), got shape {tuple(cache_shape)}")
    raise ValueError(f"prefix_block_table must be (groups, pages), got shape {tuple(table_shape)}")


def _check_groups(prefix_groups: Sequence[int] | None, num_groups: int, batch: int) -> tuple[int, ...]:
    if prefix_groups is None:
        if num_groups != 1:
            raise ValueError(f"prefix_groups is needed with {num_groups} prefixes (which requests share which)")
        return (0, batch)
    groups = tuple(int(g) for g in prefix_groups)
    if len(groups) != num_groups + 1 or groups[0] != 0 or groups[-1] != batch:
        raise ValueError(
            f"prefix_groups must be {num_groups + 1} offsets from 0 to B = {batch} (one group per prefix_block_table "
            f"row), got {groups}"
        )
    if any(a > b for a, b in zip(groups, groups[1:])):
        raise ValueError(f"prefix_groups must not decrease (requests sorted by group), got {groups}")
    return groups


def _check_suffix_covers_queries(cache_seqlens: Any, nq: int) -> None:
    """Causal with several query tokens and no append of as many: the prefix is visible to every
    query only if every request's own keys number at least Nq - 1 (else its first queries must
    not see the prefix's end, which one packed prefix call cannot express)."""
    import numpy as np

    try:
        lens = np.asarray(cache_seqlens)
    except (TypeError, RuntimeError, ValueError) as err:  # a GPU array: not readable without a sync
        raise ValueError(
            f"causal with {nq} query tokens needs each request's own keys (cache_seqlens plus the append) to number "
            "at least Nq - 1 so that every query sees the whole prefix: give k_new of Nq tokens, or cache_seqlens on "
            "the host"
        ) from err
    if lens.size and int(lens.min()) < nq - 1:
        raise ValueError(
            f"causal with {nq} query tokens: a request has {int(lens.min())} keys of its own, fewer than Nq - 1 = "
            f"{nq - 1}, so its first queries would not see the whole prefix; attend over the flat block table instead"
        )


def _prefix_splits(device: int, prefix_keys: int, heads: int, rows: int) -> int:
    """How many key ranges the composition splits the prefix into: CTAs for two waves (a CTA
    takes 128 packed rows of one head), each range at least _MIN_SPLIT_KEYS keys."""
    ctas = heads * max(-(-rows // 128), 1)
    want = max(1, (2 * _device.device_info(device).num_sms) // ctas)
    most = max(1, prefix_keys // _MIN_SPLIT_KEYS)
    return int(min(want, most, _MAX_SPLITS))
