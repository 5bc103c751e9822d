"""Shared-prefix (cascade) decoding: ``attention_with_shared_prefix``.

Requests that share a long prefix (a system prompt, parallel sampling, beams) attend to its keys
once per group instead of once per request. The keys are split in two and the two attentions
merged exactly by their LSE (``merge_states``: softmax over a union of disjoint key sets):

- the shared prefix: every query of a group against the group's prefix pages, all of them
  visible, as one packed sequence of ``attention_varlen`` over the pages (the FA2 kernel over the
  cache view), with the query heads of a KV head packed as rows (GQA: the K/V tiles are read once
  for the whole group of heads) and the prefix split into a few key ranges so that the grid fills
  the GPU (FlashDecoding's split, merged by the same LSE rule);
- each request's own suffix: ``attention_with_kvcache`` over its own pages (the split-KV decode
  kernel), with the append of ``k_new`` / ``v_new``.

Every step is a public call of the library, so the host path (any array-API namespace) runs the
same composition; no kernel of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from . import _attention, _device, _interop, _plan
from ._api import attention_with_kvcache
from ._kvcache import merge_states
from ._validate import check_options

# Splits of the prefix's keys: enough CTAs for two waves of the GPU, each split at least this
# many keys (a split's fixed cost, its partial state and a merge, is then below its read time).
_MIN_SPLIT_KEYS = 2048
_MAX_SPLITS = 32


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
    from array_api_compat import array_namespace
    from array_api_compat import device as device_of

    b, nq, hq, d = (int(n) for n in q.shape)
    if len(k_cache.shape) != 4:
        raise ValueError(f"k_cache must be paged (num_pages, page_size, Hkv, d), got shape {tuple(k_cache.shape)}")
    page_size, hkv = int(k_cache.shape[1]), int(k_cache.shape[2])
    if len(prefix_block_table.shape) != 2:
        raise ValueError(f"prefix_block_table must be (groups, pages), got shape {tuple(prefix_block_table.shape)}")
    num_groups, prefix_pages = (int(n) for n in prefix_block_table.shape)
    groups = _check_groups(prefix_groups, num_groups, b)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq = {hq} must be a multiple of Hkv = {hkv}")
    if causal and nq > 1 and (k_new is None or int(k_new.shape[1]) < nq - 1):
        _check_suffix_covers_queries(cache_seqlens, nq)
    host_lens = _host_lengths(prefix_seqlens, num_groups, prefix_pages * page_size)  # before any append
    xp = array_namespace(q)
    where = device_of(q)
    # (library, device, ...) on a GPU, None on the host; the prefix table in q's library and device
    gpu = _interop.gpu_arrays(("q", "prefix_block_table"), (q, prefix_block_table))

    # The suffix first: its append must land before anything reads the pages (no other read of
    # those pages follows, but a caller may pass the same pool as prefix and suffix).
    out_s, lse_s = attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
        causal=causal, scale=scale, softcap=softcap, num_splits=num_splits, return_lse=True,
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
    splits = _prefix_splits(gpu, prefix_pages * page_size, heads, rows)
    chunk = -(-prefix_pages // splits) if prefix_pages else 1
    splits = max(-(-prefix_pages // chunk), 1)
    chunk_keys = chunk * page_size
    table = _split_table(xp, where, prefix_block_table, splits, chunk)
    group_rows = tuple((groups[g + 1] - groups[g]) * nq * rows_per_query for g in range(num_groups))
    cu_q, cu_k = _offsets(xp, where, group_rows, splits, chunk_keys, prefix_seqlens, host_lens)
    if packed:
        q_rows = xp.reshape(xp.permute_dims(xp.reshape(q, (t, hkv, group, d)), (0, 2, 1, 3)), (rows, hkv, d))
    else:
        q_rows = xp.reshape(q, (rows, hq, d))
    if splits > 1:
        q_rows = xp.reshape(xp.broadcast_to(q_rows[None], (splits, rows, heads, d)), (splits * rows, heads, d))
    prefix_args = (q_rows, k_cache, v_cache, cu_q, cu_k, max(group_rows, default=0), chunk_keys, scale, softcap, table)
    dims = (b, nq, hq, hkv, d)
    if gpu is None:
        out_p, lse_p = _varlen(*prefix_args)
        prefix_out, prefix_lse = _merge_prefix(xp, out_p, lse_p, splits, dims, packed)
    else:
        lib, device = gpu[0], gpu[1]
        out_p, lse_p = _gpu_prefix(lib, device, *prefix_args)
        prefix_out, prefix_lse = _gpu_merge_prefix(lib, device, out_p, lse_p, splits, dims, packed)
    out, lse = merge_states(prefix_out, prefix_lse, out_s, lse_s)
    return (out, lse) if return_lse else out


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


def _host_lengths(x: Any, count: int, capacity: int) -> tuple[int, ...] | None:
    """Host prefix lengths as ``count`` ints (an int is every prefix's), each checked within the
    prefix table's ``capacity`` keys; None for an array on a device (read there, checked by the
    kernels: no synchronisation)."""
    from . import _interop

    if isinstance(x, int):
        values: tuple[int, ...] = (int(x),) * count
    elif _interop.gpu_arrays(("prefix_seqlens",), (x,)) is not None:
        return None
    else:
        import numpy as np

        values = tuple(int(n) for n in np.asarray(x).reshape(-1))
    if len(values) != count:
        raise ValueError(f"prefix_seqlens must have one entry per prefix ({count}), got {len(values)}")
    bad = [n for n in values if not 0 <= n <= capacity]
    if bad:
        raise ValueError(f"prefix_seqlens {bad} outside [0, {capacity}] (the keys prefix_block_table's pages hold)")
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


def _merge_prefix(
    xp: Any, out_p: Any, lse_p: Any, splits: int, dims: tuple[int, int, int, int, int], packed: bool
) -> tuple[Any, Any]:
    """The host's merge of the prefix's S states (the GPU's: ``_gpu_merge_prefix``): pairwise
    ``merge_states`` over the varlen output rearranged to (S, B Nq, Hq, d) and (S, Hq, B Nq)."""
    b, nq, hq, hkv, d = dims
    t, group = b * nq, hq // hkv
    if packed:
        out_p = xp.reshape(
            xp.permute_dims(xp.reshape(out_p, (splits, t, group, hkv, d)), (0, 1, 3, 2, 4)), (splits, t, hq, d)
        )
        lse_p = xp.reshape(xp.permute_dims(xp.reshape(lse_p, (hkv, splits, t, group)), (1, 0, 3, 2)), (splits, hq, t))
    else:
        out_p = xp.reshape(out_p, (splits, t, hq, d))
        lse_p = xp.permute_dims(xp.reshape(lse_p, (hq, splits, t)), (1, 0, 2))
    while splits > 1:  # pairs of parts merged at once: log2(S) rounds of one call each
        half = splits // 2
        merged, merged_lse = merge_states(out_p[:half], lse_p[:half], out_p[half : 2 * half], lse_p[half : 2 * half])
        if splits % 2:
            merged = xp.concat([merged, out_p[2 * half :]], axis=0)
            merged_lse = xp.concat([merged_lse, lse_p[2 * half :]], axis=0)
        out_p, lse_p, splits = merged, merged_lse, half + splits % 2
    prefix_out = xp.reshape(out_p[0], (b, nq, hq, d))
    prefix_lse = xp.permute_dims(xp.reshape(lse_p[0], (hq, b, nq)), (1, 0, 2))
    return prefix_out, prefix_lse


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
            q, k, v, cu_q, cu_k, max_q, max_k, check_options(False, scale, (-1, -1), softcap), block_table=table
        )
        return _plan.plan_paged_varlen(
            problem, dict(zip(named, dtypes)), _device.device_info(device), tuple(q.shape), tuple(table.shape),
            k.shape[0],
        )  # fmt: skip

    launch = _prefix_plans.get(key, plan)
    return _launch.run(launch, lib, device, named, True)


def _varlen(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, scale: Any, softcap: float, table: Any
) -> tuple[Any, Any]:
    call = _attention.VarlenForward(
        q, k, v, cu_q, cu_k, max_q, max_k, check_options(False, scale, (-1, -1), softcap), block_table=table
    )
    out, lse = _attention.varlen_forward(call, want_lse=True)
    return out, lse


def _check_groups(prefix_groups: Sequence[int] | None, num_groups: int, batch: int) -> list[int]:
    if prefix_groups is None:
        if num_groups != 1:
            raise ValueError(f"prefix_groups is needed with {num_groups} prefixes (which requests share which)")
        return [0, batch]
    groups = [int(g) for g in prefix_groups]
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


def _prefix_splits(gpu: Any, prefix_keys: int, heads: int, rows: int) -> int:
    """How many key ranges the prefix is split into on the GPU (``gpu``: gpu_arrays' answer):
    CTAs for two waves (a CTA takes 128 packed rows of one head), each range at least
    _MIN_SPLIT_KEYS keys; one on the host."""
    if gpu is None:
        return 1
    device = gpu[1]
    ctas = heads * max(-(-rows // 128), 1)
    want = max(1, (2 * _device.device_info(device).num_sms) // ctas)
    most = max(1, prefix_keys // _MIN_SPLIT_KEYS)
    return int(min(want, most, _MAX_SPLITS))
