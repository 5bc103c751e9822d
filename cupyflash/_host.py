"""Host arrays (NumPy, array_api_strict, PyTorch CPU ...): the array-API algorithms of
``xp_impl`` in the arrays' own namespace, with every value checked before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ._dispatch import BATCH_INVARIANT_SPLIT_KEYS, split_blocks
from ._validate import (
    KvCacheProblem,
    Problem,
    check_cu_seqlens_values,
    check_kvcache_values,
    check_paged_keys,
    check_seqused_values,
)


def namespace(names: tuple[str, ...], arrays: tuple[Any, ...]) -> Any:
    """The arrays' array-API namespace, or a TypeError that says what is wrong with them."""
    from array_api_compat import array_namespace

    for name, x in zip(names, arrays):
        dtype = getattr(x, "dtype", None)
        if getattr(dtype, "name", None) == "bfloat16" and type(x).__module__.split(".")[0] == "numpy":
            raise TypeError(
                f"{name} is a NumPy bfloat16 (ml_dtypes) array, which no array-API namespace takes: convert it to "
                "float32 on the host, or pass a GPU array (CuPy, PyTorch, JAX) to run the bfloat16 kernels"
            )
    try:
        return array_namespace(*arrays)
    except TypeError as error:
        raise TypeError(f"{', '.join(names)} must be arrays of one array-API namespace: {error}") from None


def _check_floats(xp: Any, named: list[tuple[str, Any]]) -> None:
    first_name, first = named[0]
    for name, x in named:
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
        if x.dtype != first.dtype:
            raise TypeError(
                f"{name} must have {first_name}'s real floating dtype {first.dtype} (one dtype for all), got {x.dtype}"
            )


def attention(
    q: Any, k: Any, v: Any, problem: Problem, algorithm: str, dropout: Any = None, alibi_slopes: Any = None,
    attn_mask: Any = None, score_mod: Any = None, mask_mod: Any = None, *, batch_invariant: bool = False,
    sinks: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """``score_mod`` / ``mask_mod``: traced (``_mods.Mod``), or None. ``batch_invariant``: the
    decode algorithm's splits of BATCH_INVARIANT_SPLIT_KEYS keys, as the GPU's (no host algorithm
    splits by the batch: its default split count follows the key count alone)."""
    from . import xp_impl

    if attn_mask is not None:
        xp = _namespace_with_slopes(("q", "k", "v", "attn_mask"), (q, k, v, attn_mask), None, sinks)
        if not (xp.isdtype(attn_mask.dtype, "bool") or xp.isdtype(attn_mask.dtype, "real floating")):
            raise TypeError(f"attn_mask must be boolean or real floating, got {attn_mask.dtype}")
    else:
        xp = _namespace_with_slopes(("q", "k", "v"), (q, k, v), alibi_slopes, sinks)
    _check_floats(xp, [("q", q), ("k", k), ("v", v)])
    # fa3 is FA2's algorithm on Hopper's instructions: on the host both are xp_impl's fa2.
    host_algorithm = "fa2" if algorithm in ("auto", "fa3") else algorithm
    splits: dict[str, Any] = (
        {"split_keys": BATCH_INVARIANT_SPLIT_KEYS} if batch_invariant and host_algorithm == "decode" else {}
    )
    return xp_impl.attention(
        xp, q, k, v, problem, algorithm=host_algorithm, dropout=dropout, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, **splits,
    )  # fmt: skip


def _keys_used(xp: Any, cu_k: Any, seqused_k: Any) -> list[int]:
    """Each sequence's end of used keys: cu_seqlens_k[b + 1], or cu_seqlens_k[b] + seqused_k[b]
    (checked to lie in the sequence, as the GPU kernels check it on the device)."""
    if seqused_k is None:
        return [int(x) for x in cu_k[1:]]
    if not xp.isdtype(seqused_k.dtype, "integral"):
        raise TypeError(f"seqused_k must be an integer array (int32, as flash-attn's), got {seqused_k.dtype}")
    return check_seqused_values([int(x) for x in cu_k], [int(x) for x in seqused_k])


def _sequence_slopes(slopes: Any, b: int) -> Any:
    """Packed sequence b's ALiBi slopes: (Hq,) as given, or row b of (B, Hq)."""
    return slopes if slopes is None or slopes.ndim == 1 else slopes[b, ...]


def _namespace_with_slopes(names: tuple[str, ...], arrays: tuple[Any, ...], slopes: Any, sinks: Any = None) -> Any:
    """The arrays' namespace, ALiBi's slopes and the sinks (real floating arrays) among them when given."""
    per_head = [(n, x) for n, x in (("alibi_slopes", slopes), ("sinks", sinks)) if x is not None]
    xp = namespace((*names, *(n for n, _ in per_head)), (*arrays, *(x for _, x in per_head)))
    for name, x in per_head:
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    return xp


def attention_backward(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any, problem: Problem, dropout: Any = None,
    alibi_slopes: Any = None, attn_mask: Any = None, score_mod: Any = None, mask_mod: Any = None, sinks: Any = None,
    captured_grads: bool = False, block: int = 64,
) -> tuple[Any, ...]:  # fmt: skip
    """(dq, dk, dv), and dsinks with ``sinks``, and with ``captured_grads`` the gradients of
    score_mod's captured arrays (``xp_impl.attention_backward``)."""
    from . import xp_impl

    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "alibi_slopes", "attn_mask", "sinks")
    arrays = (dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, sinks)
    xp = namespace(*zip(*((n, x) for n, x in zip(names, arrays) if x is not None)))
    _check_floats(xp, [("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)])
    return xp_impl.attention_backward(
        xp, dout, q, k, v, out, lse, problem, dlse=dlse, dropout=dropout, alibi_slopes=alibi_slopes,
        attn_mask=attn_mask, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, captured_grads=captured_grads,
        block=block,
    )  # fmt: skip


def _sequence(problem: Problem, b: int, rows: tuple[int, int], dropout: Any) -> tuple[Problem, Any]:
    """Packed sequence b as a dense batch of one (its mask bounds as the packed problem's, which
    are never dropped), and its dropout (the mask's batch index is the sequence's)."""
    dense = dataclasses.replace(problem, batch=1, seqlen_q=rows[0], seqlen_k=rows[1], layout="bshd")
    return dense, None if dropout is None else dataclasses.replace(dropout, batch0=b)


def attention_varlen(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, problem: Problem, dropout: Any = None, alibi_slopes: Any = None,
    seqused_k: Any = None, block_table: Any = None, sinks: Any = None, score_mod: Any = None, mask_mod: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """One dense attention per sequence, in the arrays' own namespace; with ``block_table``, each
    sequence's keys gathered from its pages first. ``score_mod`` / ``mask_mod`` (traced) see b =
    the sequence's index and q_idx, kv_idx its own positions."""
    from . import xp_impl

    names: tuple[str, ...] = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
    arrays: tuple[Any, ...] = (q, k, v, cu_q, cu_k)
    if block_table is not None:
        names, arrays = (*names, "block_table"), (*arrays, block_table)
    xp = _namespace_with_slopes(names, arrays, alibi_slopes, sinks)
    _check_floats(xp, [("q", q), ("k", k), ("v", v)])
    for name, cu in zip(names[3:], arrays[3:]):
        if not xp.isdtype(cu.dtype, "integral"):
            raise TypeError(f"{name} must be an integer array (int32, as flash-attn's), got {cu.dtype}")
    paged = block_table is not None
    total_k = None if paged else k.shape[0]
    check_cu_seqlens_values(cu_q, cu_k, q.shape[0], total_k, problem.seqlen_q, problem.seqlen_k)
    used = _keys_used(xp, cu_k, seqused_k)
    layout = _paged_layout(block_table, k.shape, used, cu_k) if paged else None
    outs, lses = [], []
    for b in range(problem.batch):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), used[b]
        if layout is not None:  # keys 0 .. k1 - k0 of sequence b, from its pages
            k_b, v_b = (layout.gather(xp, x, b, k1 - k0) for x in (k, v))
        else:
            k_b, v_b = k[k0:k1, ...], v[k0:k1, ...]
        seq = [xp.expand_dims(x, axis=0) for x in (q[q0:q1, ...], k_b, v_b)]
        dense, seq_dropout = _sequence(problem, b, (q1 - q0, k1 - k0), dropout)
        slopes = _sequence_slopes(alibi_slopes, b)
        out, lse = xp_impl.attention(
            xp, seq[0], seq[1], seq[2], dense, algorithm="fa2", dropout=seq_dropout, alibi_slopes=slopes, sinks=sinks,
            score_mod=score_mod, mask_mod=mask_mod, batch0=b,
        )  # fmt: skip
        outs.append(out[0, ...])
        lses.append(lse[0, ...])
    lse_dtype = xp_impl.compute_dtype(xp, q)
    out = xp.concat(outs, axis=0) if outs else xp.zeros((0, *q.shape[1:]), dtype=q.dtype)
    lse = xp.concat(lses, axis=1) if lses else xp.zeros((problem.heads_q, 0), dtype=lse_dtype)
    pad = q.shape[0] - int(cu_q[-1])  # rows after the last sequence: zero, LSE -inf
    if pad > 0:
        out = xp.concat([out, xp.zeros((pad, *q.shape[1:]), dtype=q.dtype)], axis=0)
        lse = xp.concat([lse, xp.full((problem.heads_q, pad), -math.inf, dtype=lse.dtype)], axis=1)
    return out, lse


def _paged_layout(table: Any, page_shape: tuple[int, ...], used: list[int], cu_k: Any) -> Any:
    """The pages of packed sequences (attention_varlen's block_table), every page in use checked."""
    from . import xp_impl

    pages, (num_pages, page_size) = host_ints(table), page_shape[:2]
    check_paged_keys(pages, [end - int(start) for end, start in zip(used, cu_k)], num_pages, page_size)
    return xp_impl.CacheLayout(pages, page_size)


def attention_varlen_backward(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any, cu_q: Any, cu_k: Any, problem: Problem,
    dropout: Any = None, alibi_slopes: Any = None, seqused_k: Any = None, sinks: Any = None, score_mod: Any = None,
    mask_mod: Any = None, captured_grads: bool = False, block: int = 64,
) -> tuple[Any, ...]:  # fmt: skip
    """One dense backward per sequence; packed rows outside every sequence (and keys past
    ``seqused_k``) get zero gradients. With ``sinks``, dsinks too (the sequences' sum); with
    ``captured_grads``, the gradients of score_mod's captured arrays last (the sequences' sum,
    added in the compute dtype). ``score_mod`` / ``mask_mod``: as ``attention_varlen``'s."""
    from . import xp_impl

    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "seqused_k",
             "sinks")  # fmt: skip
    arrays = (dout, q, k, v, out, lse, dlse, cu_q, cu_k, alibi_slopes, seqused_k, sinks)
    xp = namespace(*zip(*((n, x) for n, x in zip(names, arrays) if x is not None)))
    check_cu_seqlens_values(cu_q, cu_k, q.shape[0], k.shape[0], problem.seqlen_q, problem.seqlen_k)
    # cu_seqlens start at 0 and do not decrease (checked): the sequences tile rows [0, cu[-1])
    # in order, so each gradient is the sequences' pieces, then zeros for the rows after them.
    pieces: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    compute = xp_impl.compute_dtype(xp, q)
    dsinks = None if sinks is None else xp.zeros_like(xp.astype(sinks, compute))
    captured: list[Any] | None = None  # score_mod's arrays' gradients, summed over the sequences
    used = _keys_used(xp, cu_k, seqused_k)
    for b in range(problem.batch):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), used[b]
        dout_b, q_b, out_b = (xp.expand_dims(x[q0:q1, ...], axis=0) for x in (dout, q, out))
        k_b, v_b = (xp.expand_dims(x[k0:k1, ...], axis=0) for x in (k, v))
        lse_b, dlse_b = (None if x is None else xp.expand_dims(x[:, q0:q1], axis=0) for x in (lse, dlse))
        dense, seq_dropout = _sequence(problem, b, (q1 - q0, k1 - k0), dropout)
        slopes = _sequence_slopes(alibi_slopes, b)
        grads = xp_impl.attention_backward(
            xp, dout_b, q_b, k_b, v_b, out_b, lse_b, dense, dlse=dlse_b, dropout=seq_dropout, alibi_slopes=slopes,
            sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, captured_grads=captured_grads, block=block, batch0=b,
        )  # fmt: skip
        if dsinks is not None:
            dsinks = dsinks + grads[3]
        if captured_grads:
            sequence = [None if g is None else xp.astype(g, compute) for g in grads[-1]]
            captured = sequence if captured is None else [t if t is None else t + g for t, g in zip(captured, sequence)]
        for piece, grad in zip(pieces, grads[:3]):
            piece.append(grad[0, ...])
        # keys past seqused_k: no gradient (zeros where x lives, as its rows' slice)
        for piece, x in zip(pieces[1:], (k, v)):
            piece.append(xp.zeros_like(x[k1 : int(cu_k[b + 1]), ...]))
    ends = (int(cu_q[-1]), int(cu_k[-1]), int(cu_k[-1]))
    grads = tuple(
        xp.concat([*piece, xp.zeros_like(x[end:, ...])], axis=0) for piece, x, end in zip(pieces, (q, k, v), ends)
    )
    if dsinks is not None:
        grads = (*grads, dsinks)
    if captured_grads:
        from array_api_compat import device  # (the arrays as xp_impl.Mods.of reads them: in xp, on q's device)

        tables = [xp.asarray(x, device=device(q)) for x in score_mod.buffers]
        if captured is None:  # no sequence: every gradient 0
            captured = [xp.zeros_like(x, dtype=compute) if xp.isdtype(x.dtype, "real floating") else None
                        for x in tables]  # fmt: skip
        grads = (*grads, tuple(None if g is None else xp.astype(g, x.dtype) for g, x in zip(captured, tables)))
    return grads


# num_splits=0 on the host (no SM count to fill): one split per 4 blocks of 64 keys, as the GPU's
# smallest split. Any count gives the same answer up to rounding (the merge is exact).
_HOST_BLOCK_N = 64
_HOST_BLOCKS_PER_SPLIT = 4


def kvcache_split_keys(capacity: int, num_splits: int, batch_invariant: bool = False) -> int:
    """Keys per split of the host's cache call: BATCH_INVARIANT_SPLIT_KEYS with ``batch_invariant``
    (the GPU kernel's split, so both split a sequence at the same keys), else ``num_splits`` (0:
    one per _HOST_BLOCKS_PER_SPLIT blocks) over the capacity."""
    if batch_invariant:
        return BATCH_INVARIANT_SPLIT_KEYS
    key_blocks = -(-capacity // _HOST_BLOCK_N)
    per_split, _ = split_blocks(key_blocks, num_splits or max(1, key_blocks // _HOST_BLOCKS_PER_SPLIT))
    return per_split * _HOST_BLOCK_N


def attention_with_kvcache(
    q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any, p: KvCacheProblem,
    num_splits: int, batch_idx: Any = None, leftpad: Any = None, alibi_slopes: Any = None,
    rotary_cos: Any = None, rotary_sin: Any = None, fp8: tuple[str, Any, Any] | None = None,
    batch_invariant: bool = False, sinks: Any = None, tree_mask: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """``fp8``: (format, k_scale, v_scale) of float8 caches (``_fp8``): k_new / v_new quantised on
    append, the attention over the dequantised caches. Each sequence is computed alone (its
    query rows over its own keys), so with ``batch_invariant`` (a split size fixed in keys, not a
    count over the capacity) its result does not depend on the batch. ``tree_mask``: bool, the
    drafts each query token sees (``p.tree_mask_shape``)."""
    from . import _fp8, xp_impl

    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": seqlens, "block_table": table,
             "k_new": k_new, "v_new": v_new, "cache_batch_idx": batch_idx, "cache_leftpad": leftpad,
             "alibi_slopes": alibi_slopes, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
             "sinks": sinks, "tree_mask": tree_mask}  # fmt: skip
    arrays = {n: x for n, x in named.items() if x is not None and type(x) is not int}
    xp = namespace(tuple(arrays), tuple(arrays.values()))
    check_kvcache_dtypes(xp, arrays, fp8_cache=fp8 is not None)
    scales = None
    if fp8 is not None:  # checked before anything is written
        heads_kv = k_cache.shape[2]
        scales = [
            _fp8.host_scale_array(xp, n, s, heads_kv, k_cache) for n, s in (("k_scale", fp8[1]), ("v_scale", fp8[2]))
        ]
    cached = [seqlens] * p.attn.batch if type(seqlens) is int else host_ints(seqlens)
    pages = None if table is None else host_ints(table)
    entries = None if batch_idx is None else host_ints(batch_idx)
    first_keys = None if leftpad is None else host_ints(leftpad)
    check_kvcache_values(cached, pages, p, entries, first_keys)
    layout = xp_impl.CacheLayout(pages, p.page_size, entries)
    if p.rotary_half:  # k_new at its cache positions, q at the first new one (+ i per token)
        nq = p.attn.seqlen_q
        k_new = xp_impl.rotary(
            xp, k_new, rotary_cos, rotary_sin, [[n + t for t in range(p.seqlen_new)] for n in cached],
            p.rotary_interleaved,
        )  # fmt: skip
        step = 1 if p.rotary_q_per_token else 0
        q = xp_impl.rotary(
            xp, q, rotary_cos, rotary_sin, [[n + step * i for i in range(nq)] for n in cached], p.rotary_interleaved
        )
    if fp8 is not None and scales is not None:
        fmt = fp8[0]
        if k_new is not None:  # stored as the kernels' append stores it
            k_new, v_new = (
                _fp8.quantise(xp, x, fmt, s, c) for x, s, c in zip((k_new, v_new), scales, (k_cache, v_cache))
            )
            xp_impl.append_kv(xp, k_cache, k_new, cached, layout)
            xp_impl.append_kv(xp, v_cache, v_new, cached, layout)
        compute = xp_impl.compute_dtype(xp, q)
        k_cache, v_cache = (
            _fp8.dequantise(xp, n, c, fmt, s, compute)
            for n, c, s in zip(("k_cache", "v_cache"), (k_cache, v_cache), scales)
        )
    elif k_new is not None:
        xp_impl.append_kv(xp, k_cache, k_new, cached, layout)
        xp_impl.append_kv(xp, v_cache, v_new, cached, layout)
    split_keys = kvcache_split_keys(p.capacity, num_splits, batch_invariant)
    lengths = [n + p.seqlen_new for n in cached]
    return xp_impl.attention_with_kvcache(
        xp, q, k_cache, v_cache, lengths, layout, p.attn, split_keys, first_keys, alibi_slopes, sinks, tree_mask
    )


_KV_INDEX_NAMES = ("cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad")


def check_kvcache_dtypes(xp: Any, arrays: dict[str, Any], fp8_cache: bool = False) -> None:
    """The dtypes of a cache call's arrays (by name, those given), in namespace ``xp``: one real
    floating dtype for q, the caches (unless ``fp8_cache``: float8 or bytes, checked by ``_fp8``),
    k_new / v_new and the rotary tables, integers for the indices (the GPU kernels also want
    int32, float16 / bfloat16 and float32 slopes: the plan checks those)."""
    skip = {*_KV_INDEX_NAMES, "alibi_slopes", "sinks", "tree_mask", *(("k_cache", "v_cache") if fp8_cache else ())}
    _check_floats(xp, [(n, x) for n, x in arrays.items() if n not in skip])
    if "sinks" in arrays and not xp.isdtype(arrays["sinks"].dtype, "real floating"):
        raise TypeError(f"sinks must have a real floating dtype, got {arrays['sinks'].dtype}")
    for name in _KV_INDEX_NAMES:
        x = arrays.get(name)
        if x is not None and not xp.isdtype(x.dtype, "integral"):
            raise TypeError(f"{name} must be an integer array (int32), got {x.dtype}")
    tree = arrays.get("tree_mask")
    if tree is not None and not xp.isdtype(tree.dtype, "bool"):
        raise TypeError(f"tree_mask must be a bool array, got {tree.dtype}")


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    from . import xp_impl

    xp = namespace(("o_a", "lse_a", "o_b", "lse_b"), (o_a, lse_a, o_b, lse_b))
    if o_a.dtype != o_b.dtype or not xp.isdtype(o_a.dtype, "real floating"):
        raise TypeError(f"o_a and o_b must have one real floating dtype, got {o_a.dtype} and {o_b.dtype}")
    return xp_impl.merge_states(xp, o_a, lse_a, o_b, lse_b)


def host_ints(x: Any) -> Any:
    """An integer host array of any namespace as (nested) Python lists."""
    from .reference import to_numpy64

    return to_numpy64(x).astype(int).tolist()
