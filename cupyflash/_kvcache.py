"""Decoding over a KV cache: ``attention_with_kvcache`` (FlashDecoding, as flash-attn's
``flash_attn_with_kvcache``) and ``merge_states`` (the exact merge of two attention states).

On the GPU a call is at most two launches on the caller's stream -- append k_new / v_new into
the cache, then the split-KV kernel (whose last split of each row merges the partials: no
combine launch) -- and everything that depends only on shapes, dtypes and options is a cached
``_DecodePlan``. The splits' tickets and partials live in a per-stream buffer (``_workspace``). Device
arrays are never read back on the host: an int ``cache_seqlens`` is checked here, array values
(``cache_seqlens``, ``block_table``) are clamped by the kernels so that a wrong value gives a
wrong answer but never an access outside the cache. Host arrays run ``xp_impl`` in their own
namespace, with every value checked before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, overload

from . import _api, _interop, _kernels, _workspace
from ._dispatch import decode_num_splits, decode_spec, split_blocks
from ._specs import CUDA_ELEMENT_TYPES, DECODE_HEAD_DIMS, DECODE_MAX_QUERIES, DecodeAppendSpec, MergeSpec
from ._validate import (
    KvCacheProblem,
    check_int_seqlens,
    check_kvcache_values,
    check_num_splits,
    kvcache_problem,
    merge_problem,
)


@overload
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = ...,
    k_new: Any = ...,
    v_new: Any = ...,
    causal: bool = ...,
    scale: float | None = ...,
    num_splits: int = ...,
    return_lse: Literal[False] = ...,
) -> Any: ...
@overload
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = ...,
    k_new: Any = ...,
    v_new: Any = ...,
    causal: bool = ...,
    scale: float | None = ...,
    num_splits: int = ...,
    return_lse: Literal[True],
) -> tuple[Any, Any]: ...
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = None,
    k_new: Any = None,
    v_new: Any = None,
    causal: bool = True,
    scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
) -> Any:
    """Attention of a few new query tokens over a KV cache, as flash-attn's
    ``flash_attn_with_kvcache`` (FlashDecoding: the keys are split over many CTAs and the
    partial results merged exactly).

    Parameters
    ----------
    q : array ``(B, Nq, Hq, d)``; on the GPU ``1 <= Nq <= 16``, float16 or bfloat16, d in 64, 128, 256
    k_cache, v_cache : arrays, contiguous ``(B, L_max, Hkv, d)``, or paged
        ``(num_pages, page_size, Hkv, d)`` with ``block_table``; ``page_size`` any power of two
        (1, 2, ..., 16, ..., 256 ...). Same library, device and dtype as ``q``; ``Hq % Hkv == 0``.
        Modified in place when ``k_new`` / ``v_new`` are given.
    cache_seqlens : int or int32 array ``(B,)``
        Tokens already in each sequence's cache.
    block_table : int32 array ``(B, max_pages)``, optional
        Page of each ``page_size`` keys of each sequence: key ``j`` of sequence ``b`` is slot
        ``j % page_size`` of page ``block_table[b, j // page_size]``.
    k_new, v_new : arrays ``(B, Nnew, Hkv, d)``, optional
        Written into the cache at positions ``cache_seqlens[b] ..`` before attending; the
        attention then covers ``Nk_b = cache_seqlens[b] + Nnew`` keys.
    causal : bool
        Bottom-right aligned within each sequence: query ``i`` sees key ``j`` iff
        ``j <= i + Nk_b - Nq``. For Nq = 2 over Nk_b = 5 keys (1 = visible)::

            1 1 1 1 0
            1 1 1 1 1

        With one query token it changes nothing.
    scale : float, optional
        Defaults to ``1 / sqrt(d)``.
    num_splits : int
        Splits of the KV sequence: 0 chooses from the GPU's SM count, the batch, the heads and
        the cache length; 1 runs the same kernel without splitting (no combine step).
    return_lse : bool
        Also return the float32 natural-log LSE ``(B, Hq, Nq)``.

    Returns
    -------
    out : array like ``q``; lse : float32 ``(B, Hq, Nq)`` when ``return_lse``

    Notes
    -----
    On the GPU, an int ``cache_seqlens`` is checked against the cache on the host; values of
    device arrays are not read back (that would synchronise the device every step): the
    kernels clamp each sequence's length to the cache capacity and each page number into the
    cache, so a wrong value gives a wrong answer but never an access outside the cache. Host
    arrays are checked in full before anything is written. The GPU path makes no
    synchronisation and no allocation outside the caller's library, so a decode step can be
    captured in a CUDA graph (warm it up once first: the first call compiles its kernels).

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    >>> v_cache = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    >>> q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    >>> k_new = v_new = np.ones((2, 1, 1, 8), dtype=np.float32)
    >>> seqlens = np.array([3, 9], dtype=np.int32)
    >>> out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new)
    >>> out.shape, float(k_cache[1, 9, 0, 0])
    ((2, 1, 4, 8), 1.0)
    """
    kind = _interop.same_array_kind(q, k_cache, v_cache)
    if kind in (_interop.TORCH, _interop.CUPY):
        device = _gpu_device(kind, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
        if device is not None:
            return _gpu_kvcache(
                _ARRAY_OPS[kind], q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                device, (causal, scale, num_splits), return_lse,
            )  # fmt: skip
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table), ("k_new", k_new), ("v_new", v_new)):
        if x is not None and not isinstance(x, int):
            arrays[name] = x
    kind, device = _interop.common_placement(**arrays)
    problem = _problem(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale)
    num_splits = check_num_splits(num_splits)
    if kind == _interop.HOST:
        out, lse = _host_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, problem, num_splits)
        return (out, lse) if return_lse else out
    raise TypeError(
        f"attention_with_kvcache on the GPU takes CuPy arrays or PyTorch tensors (the cache is written in place), "
        f"got {type(q).__module__}.{type(q).__name__}"
    )


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Exact merge of two attention states over disjoint key sets (the basis of cascade and
    context-parallel attention): with ``lse = log(exp(lse_a) + exp(lse_b))``,
    ``o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b``.

    Parameters
    ----------
    o_a, o_b : arrays ``(B, N, H, d)``, each normalised over its own keys (as ``attention``
        returns it); on the GPU float16, bfloat16 or float32, d a multiple of 32 up to 256.
    lse_a, lse_b : float32 arrays ``(B, H, N)``, natural log; ``-inf`` marks a row that saw no
        key (it weighs nothing; both empty gives 0 and ``-inf``).

    Returns
    -------
    (o, lse) : o like ``o_a``, lse float32 ``(B, H, N)``

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
    b, n, h, d = merge_problem(o_a.shape, lse_a.shape, o_b.shape, lse_b.shape)
    kind, device = _interop.common_placement(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if kind == _interop.HOST:
        from array_api_compat import array_namespace

        from . import xp_impl

        xp = array_namespace(o_a, lse_a, o_b, lse_b)
        if o_a.dtype != o_b.dtype or not xp.isdtype(o_a.dtype, "real floating"):
            raise TypeError(f"o_a and o_b must have one real floating dtype, got {o_a.dtype} and {o_b.dtype}")
        return xp_impl.merge_states(xp, o_a, lse_a, o_b, lse_b)
    if kind not in _ARRAY_OPS:
        raise TypeError(f"merge_states on the GPU takes CuPy arrays or PyTorch tensors, got {type(o_a).__name__}")
    return _gpu_merge_states(_ARRAY_OPS[kind], o_a, lse_a, o_b, lse_b, device, (b, n, h, d))


def _problem(
    q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any, causal: Any, scale: Any
) -> KvCacheProblem:
    return kvcache_problem(
        tuple(q.shape), tuple(k_cache.shape), tuple(v_cache.shape), cache_seqlens=seqlens,
        block_table_shape=None if table is None else tuple(table.shape),
        k_new_shape=None if k_new is None else tuple(k_new.shape),
        v_new_shape=None if v_new is None else tuple(v_new.shape), causal=causal, scale=scale,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host arrays: the array-API twin, every value checked before the cache is written.
# ---------------------------------------------------------------------------------------------
# num_splits=0 on the host (no SM count to fill): one split per 4 blocks of 64 keys, as the GPU's
# smallest split. Any count gives the same answer up to rounding (the merge is exact).
_HOST_BLOCK_N = 64
_HOST_BLOCKS_PER_SPLIT = 4


def _host_kvcache(
    q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any, p: KvCacheProblem,
    num_splits: int,
) -> tuple[Any, Any]:  # fmt: skip
    from array_api_compat import array_namespace

    from . import xp_impl

    xp = array_namespace(q, k_cache, v_cache)
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    tensors += [] if k_new is None else [("k_new", k_new), ("v_new", v_new)]
    for name, x in tensors:
        if not xp.isdtype(x.dtype, "real floating") or x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's real floating dtype {q.dtype}, got {x.dtype}")
    for name, x in (("cache_seqlens", seqlens), ("block_table", table)):
        if x is not None and not isinstance(x, int) and not xp.isdtype(x.dtype, "integral"):
            raise TypeError(f"{name} must be an integer array (int32), got {x.dtype}")
    cached = [seqlens] * p.attn.batch if isinstance(seqlens, int) else _host_ints(seqlens)
    pages = None if table is None else _host_ints(table)
    check_kvcache_values(cached, pages, p)
    layout = xp_impl.CacheLayout(pages, p.page_size)
    if k_new is not None:
        xp_impl.append_kv(xp, k_cache, k_new, cached, layout)
        xp_impl.append_kv(xp, v_cache, v_new, cached, layout)
    block_n = _HOST_BLOCK_N
    key_blocks = -(-p.capacity // block_n)
    splits = num_splits or max(1, key_blocks // _HOST_BLOCKS_PER_SPLIT)
    per_split, _ = split_blocks(key_blocks, splits)
    lengths = [n + p.seqlen_new for n in cached]
    return xp_impl.attention_with_kvcache(xp, q, k_cache, v_cache, lengths, layout, p.attn, per_split * block_n)


def _host_ints(x: Any) -> Any:
    """An integer host array of any namespace as (nested) Python lists."""
    from .reference import to_numpy64

    return to_numpy64(x).astype(int).tolist()


# ---------------------------------------------------------------------------------------------
# GPU.
# ---------------------------------------------------------------------------------------------
class _TorchOps:
    kind = _interop.TORCH

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data_ptr())

    @staticmethod
    def strides(x: Any) -> tuple[int, ...]:
        return tuple(x.stride())

    @staticmethod
    def dtype_name(x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    @staticmethod
    def device(x: Any) -> int:
        return int(x.get_device())

    @staticmethod
    def empty(shape: tuple[int, ...], like: Any, float32: bool = False) -> Any:
        torch = _interop.torch_module()
        return torch.empty(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)

    @staticmethod
    def fill(x: Any, value: float) -> None:
        x.fill_(value)

    @staticmethod
    def contiguous(x: Any) -> Any:
        return x.contiguous()

    @staticmethod
    def stream(device: int) -> int:
        return _interop.torch_current_stream(device)


class _CupyOps:
    kind = _interop.CUPY

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data.ptr)

    strides = staticmethod(_interop.element_strides)

    @staticmethod
    def dtype_name(x: Any) -> str:
        return str(x.dtype.name)

    @staticmethod
    def device(x: Any) -> int:
        return int(x.data.device_id)

    @staticmethod
    def empty(shape: tuple[int, ...], like: Any, float32: bool = False) -> Any:
        cupy = _interop.cupy_module()
        return cupy.empty(shape, dtype=cupy.float32 if float32 else like.dtype)

    @staticmethod
    def fill(x: Any, value: float) -> None:
        x.fill(value)

    @staticmethod
    def contiguous(x: Any) -> Any:
        import cupy

        return cupy.ascontiguousarray(x)

    @staticmethod
    def stream(device: int) -> int:
        return int(_interop.cupy_module().cuda.get_current_stream().ptr)


_ArrayOps = type[_TorchOps] | type[_CupyOps]
_ARRAY_OPS: dict[str, Any] = {_interop.TORCH: _TorchOps, _interop.CUPY: _CupyOps}


def _gpu_device(kind: str, q: Any, *others: Any) -> int | None:
    """The GPU of the lean path when every array argument is of q's type and on q's GPU."""
    ops = _ARRAY_OPS[kind]
    device = ops.device(q)
    if device < 0:
        return None
    cls = type(q)
    for x in others:
        if x is None or type(x) is int:
            continue
        if type(x) is not cls or ops.device(x) != device:
            return None
    return int(device)


# Element strides the kernels take: q, k_cache, v_cache (batch, row, head) and k_new, v_new
# (batch, row, head each, zeros without them).
_OperandStrides = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    partial: _kernels.CompiledKernel | None  # None when there is nothing to compute
    append: _kernels.CompiledKernel | None  # None without k_new / v_new
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    smem: int
    append_grid: tuple[int, int, int]
    num_splits: int
    negate_q: bool
    lse_shape: tuple[int, int, int]
    operand_strides: _OperandStrides | None  # q, k_cache, v_cache, (k_new, v_new); None: copies
    seqlens_contiguous: bool
    table_contiguous: bool
    table_stride: int
    capacity: int  # keys one sequence can hold
    seqlen_new: int  # tokens appended per call
    counter_bytes: int  # int32 split tickets per (batch, KV head, m-block); 0 with one split
    scratch_bytes: int  # fp32 partial O then partial LSE; 0 with one split
    partial_lse_offset: int  # bytes from the scratch start to the partial LSE
    attn_head: tuple[int, ...]  # AttnParams from the o strides to seqlen_q
    attn_tail: tuple[int | float, ...]  # AttnParams after seqlen_k (an int cache_seqlens, per call)
    decode_tail: tuple[int, ...]  # DecodeParams from seqlen_new on


_plans: dict[tuple[Any, ...], _DecodePlan] = {}
_ctas_per_sm: dict[tuple[str, int], int] = {}


def _occupancy(kernel: _kernels.CompiledKernel, device: int) -> int:
    """Resident CTAs per SM (registers and shared memory), as the driver computes it."""
    key = (kernel.spec.name, device)
    ctas = _ctas_per_sm.get(key)
    if ctas is None:
        import cupy
        from cupy_backends.cuda.api import driver

        with cupy.cuda.Device(device):
            ctas = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                kernel.function.ptr, kernel.spec.num_threads, kernel.spec.smem_bytes
            )
        ctas = _ctas_per_sm[key] = max(1, int(ctas))
    return ctas


def _check_gpu_types(ops: Any, q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any, ints: Any) -> str:
    dtype = ops.dtype_name(q)
    tensors = [("k_cache", k_cache), ("v_cache", v_cache)] + (
        [] if k_new is None else [("k_new", k_new), ("v_new", v_new)]
    )
    for name, x in tensors:
        if ops.dtype_name(x) != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}, got {ops.dtype_name(x)}")
    if dtype not in CUDA_ELEMENT_TYPES:
        raise TypeError(f"the GPU kernels take {sorted(CUDA_ELEMENT_TYPES)}, got {dtype}")
    for name, x in ints:
        if x is not None and not isinstance(x, int) and ops.dtype_name(x) != "int32":
            raise TypeError(f"{name} must be int32 (as flash-attn's), got {ops.dtype_name(x)}")
    return dtype


def _make_plan(
    ops: Any, q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any, device: int,
    options: tuple[Any, ...],
) -> _DecodePlan:  # fmt: skip
    causal, scale, num_splits = options
    p = _problem(q, k_cache, v_cache, seqlens, table, k_new, v_new, causal, scale)
    requested = check_num_splits(num_splits)
    dtype = _check_gpu_types(
        ops, q, k_cache, v_cache, k_new, v_new, (("cache_seqlens", seqlens), ("block_table", table))
    )
    a = p.attn
    if a.head_dim not in DECODE_HEAD_DIMS:
        raise ValueError(f"the decode kernels support head_dim in {DECODE_HEAD_DIMS}, got {a.head_dim}")
    if a.seqlen_q > DECODE_MAX_QUERIES:
        raise ValueError(
            f"attention_with_kvcache on the GPU takes 1 to {DECODE_MAX_QUERIES} query tokens, got {a.seqlen_q}"
        )
    if a.batch > 65535 or a.heads_kv > 65535 or p.seqlen_new > 2**31 - 1:
        raise ValueError(f"batch ({a.batch}) and heads ({a.heads_kv}) must be <= 65535 on the GPU")
    if p.capacity >= 2**31 - 64:
        raise ValueError(f"a cache of {p.capacity} tokens per sequence is beyond the kernels' int32 positions")
    scale_log2, _, negate_q = _api._softmax_factors(a)
    group = a.heads_q // a.heads_kv
    rows = group * a.seqlen_q
    lse_shape = (a.batch, a.heads_q, a.seqlen_q)
    spec = decode_spec(dtype, a.head_dim, rows, a.causal_bound)
    empty = a.batch == 0 or a.seqlen_q == 0 or a.heads_q == 0
    partial = None if empty else _kernels.get_kernel(spec, device)
    block_n = spec.tile.block_n
    m_blocks = -(-rows // spec.tile.block_m)
    key_blocks = -(-p.capacity // block_n)
    ctas = a.batch * a.heads_kv * m_blocks
    if requested == 0 and partial is not None:
        requested = decode_num_splits(
            ctas=ctas,
            key_blocks=key_blocks,
            num_sms=_interop.device_attribute(device, "MultiProcessorCount"),
            ctas_per_sm=_occupancy(partial, device),
        )
    per_split, splits = split_blocks(key_blocks, max(requested, 1))
    append = None
    if p.seqlen_new and a.batch and a.heads_kv:
        append = _kernels.get_kernel(DecodeAppendSpec(dtype, a.head_dim), device)
    d, hq, nq = a.head_dim, a.heads_q, a.seqlen_q
    o_strides = (nq * hq * d, hq * d, d)
    lse_strides = (hq * nq, nq)
    split = splits > 1 and partial is not None
    row_count = a.batch * a.heads_q * a.seqlen_q
    return _DecodePlan(
        partial=partial,
        append=append,
        operand_strides=_layout_strides(ops, q, k_cache, v_cache, k_new, v_new),
        seqlens_contiguous=isinstance(seqlens, int) or ops.strides(seqlens)[0] == 1,
        table_contiguous=table is None or ops.strides(table)[1] == 1,
        table_stride=0 if table is None else (ops.strides(table)[0] if ops.strides(table)[1] == 1 else table.shape[1]),
        grid=(splits * m_blocks, a.heads_kv, a.batch),
        threads=(spec.num_threads, 1, 1),
        smem=spec.smem_bytes,
        append_grid=(p.seqlen_new, a.heads_kv, a.batch),
        num_splits=splits,
        negate_q=negate_q,
        lse_shape=lse_shape,
        capacity=p.capacity,
        seqlen_new=p.seqlen_new,
        counter_bytes=4 * ctas if split else 0,
        scratch_bytes=4 * row_count * (d + 1) * splits if split else 0,
        partial_lse_offset=4 * row_count * d * splits,
        attn_head=(*o_strides, *lse_strides, a.batch, a.seqlen_q),
        attn_tail=(a.heads_q, a.heads_kv, group, a.window_left, a.window_right, scale_log2, 0.0),
        decode_tail=(p.seqlen_new, p.page_size_log2, p.num_pages, p.capacity, splits, per_split),
    )


def _layout_strides(ops: Any, q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any) -> _OperandStrides | None:
    """The operands' strides when their layouts are readable as they are (the per-call check is
    then only the pointers' alignment), else None."""
    arrays = [q, k_cache, v_cache] + ([] if k_new is None else [k_new, v_new])
    strides = [ops.strides(x) for x in arrays]
    if not all(_interop.kernel_readable(0, x.shape, s) for x, s in zip(arrays, strides, strict=True)):
        return None
    new = (0,) * 6 if k_new is None else (*strides[3][:3], *strides[4][:3])
    return (strides[0][:3], strides[1][:3], strides[2][:3], new)


def _operand(ops: Any, x: Any, name: str, *, in_place: bool) -> tuple[Any, int, tuple[int, ...]]:
    """(array, pointer, strides) as the kernels read it: x itself when it has a unit stride on d
    and 16-byte aligned strides, else a copy -- except for a cache, which is written in place
    and cannot be copied."""
    ptr, strides = ops.ptr(x), ops.strides(x)
    if _interop.kernel_readable(ptr, x.shape, strides):
        return x, ptr, strides
    if in_place:
        raise ValueError(
            f"{name} must have a unit stride on head_dim and 16-byte aligned strides (it is written in place)"
        )
    x = _interop.readable_copy(ops.kind, x)
    return x, ops.ptr(x), ops.strides(x)


def _gpu_kvcache(
    ops: Any, q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any, v_new: Any, device: int,
    options: tuple[Any, ...], return_lse: bool,
) -> Any:  # fmt: skip
    # The key holds the strides too: a plan then knows its operands' layouts, and a call whose
    # pointers are 16-byte aligned launches with no per-operand checks (the per-token path).
    strides = ops.strides
    key = (
        ops.kind, device, options, q.shape, strides(q), q.dtype,
        k_cache.shape, strides(k_cache), k_cache.dtype, v_cache.shape, strides(v_cache), v_cache.dtype,
        None if isinstance(seqlens, int) else (seqlens.shape, strides(seqlens), seqlens.dtype),
        None if table is None else (table.shape, strides(table), table.dtype),
        None if k_new is None else (k_new.shape, strides(k_new), k_new.dtype, v_new.shape, strides(v_new), v_new.dtype),
    )  # fmt: skip
    try:
        plan = _plans.get(key)
        cacheable = True
    except TypeError:  # an unhashable option: plan without caching
        plan, cacheable = None, False
    if plan is None:
        plan = _make_plan(ops, q, k_cache, v_cache, seqlens, table, k_new, v_new, device, options)
        if cacheable:
            if len(_plans) >= _api._MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    if _api._current_device() != device:
        import cupy

        with cupy.cuda.Device(device):
            return _run(ops, plan, q, k_cache, v_cache, seqlens, table, k_new, v_new, device, return_lse)
    return _run(ops, plan, q, k_cache, v_cache, seqlens, table, k_new, v_new, device, return_lse)


def _run(
    ops: Any, plan: _DecodePlan, q: Any, k_cache: Any, v_cache: Any, seqlens: Any, table: Any, k_new: Any,
    v_new: Any, device: int, return_lse: bool,
) -> Any:  # fmt: skip
    ptr = ops.ptr
    if k_new is None:
        ptrs: tuple[int, ...] = (ptr(q), ptr(k_cache), ptr(v_cache), 0, 0)
    else:
        ptrs = (ptr(q), ptr(k_cache), ptr(v_cache), ptr(k_new), ptr(v_new))
    operand_strides = plan.operand_strides
    keep = ()  # copies made for this call, alive until the launch
    if operand_strides is None or plan.negate_q or (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) % 16:
        keep, ptrs, operand_strides = _readable_operands(ops, plan, q, k_cache, v_cache, k_new, v_new)
    seqlen_int, seqlens_ptr = 0, 0
    if isinstance(seqlens, int):  # the plan is shared by every int: check this one
        check_int_seqlens(seqlens, plan.capacity, plan.seqlen_new)
        seqlen_int = seqlens
    else:
        if not plan.seqlens_contiguous:
            seqlens = ops.contiguous(seqlens)
        seqlens_ptr = ptr(seqlens)
    table_ptr = 0
    if table is not None:
        if not plan.table_contiguous:
            table = ops.contiguous(table)
        table_ptr = ptr(table)

    out = ops.empty(q.shape, q)
    lse = ops.empty(plan.lse_shape, q, float32=True) if return_lse else None
    if _api.POISON_OUTPUTS:
        ops.fill(out, math.nan)
        if lse is not None:
            ops.fill(lse, math.nan)
    stream = ops.stream(device)
    counters = partial_o = partial_lse = 0
    if plan.counter_bytes:  # split: the stream's tickets (left at 0 by the kernel) and partials
        counters, partial_o = _workspace.stream_scratch(
            ops.kind, device, stream, plan.counter_bytes, plan.scratch_bytes, poison=_api.POISON_OUTPUTS
        )
        partial_lse = partial_o + plan.partial_lse_offset
    qs, ks, vs, new_strides = operand_strides
    values = (
        ptrs[0], ptrs[1], ptrs[2], ptr(out), 0 if lse is None else ptr(lse), 0, 0, *qs, *ks, *vs,
        *plan.attn_head, seqlen_int, *plan.attn_tail,
        seqlens_ptr, table_ptr, ptrs[3], ptrs[4], partial_o, partial_lse, counters, plan.table_stride,
        *new_strides, *plan.decode_tail,
    )  # fmt: skip
    if plan.append is not None:
        plan.append.launch(plan.append_grid, (32, 1, 1), 0, stream, *values)
    if plan.partial is not None:
        plan.partial.launch(plan.grid, plan.threads, plan.smem, stream, *values)
    del keep
    return (out, lse) if return_lse else out


def _readable_operands(
    ops: Any, plan: _DecodePlan, q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any
) -> tuple[tuple[Any, ...], tuple[int, ...], _OperandStrides]:
    """The general path: q (negated for a negative scale), k_new and v_new copied where the
    kernels cannot read them as they are; a cache that cannot be read is an error."""
    if plan.negate_q:
        q = -q
    q, q_ptr, qs = _operand(ops, q, "q", in_place=False)
    _, k_ptr, ks = _operand(ops, k_cache, "k_cache", in_place=True)
    _, v_ptr, vs = _operand(ops, v_cache, "v_cache", in_place=True)
    base = (qs[:3], ks[:3], vs[:3])
    if k_new is None:
        return (q,), (q_ptr, k_ptr, v_ptr, 0, 0), (*base, (0,) * 6)
    k_new, kn_ptr, kns = _operand(ops, k_new, "k_new", in_place=False)
    v_new, vn_ptr, vns = _operand(ops, v_new, "v_new", in_place=False)
    return (q, k_new, v_new), (q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr), (*base, (*kns[:3], *vns[:3]))


def _gpu_merge_states(
    ops: Any, o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, device: int, dims: tuple[int, int, int, int]
) -> tuple[Any, Any]:
    b, n, h, d = dims
    dtype = ops.dtype_name(o_a)
    if ops.dtype_name(o_b) != dtype:
        raise TypeError(f"o_a and o_b must have one dtype, got {dtype} and {ops.dtype_name(o_b)}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if ops.dtype_name(x) != "float32":
            raise TypeError(f"{name} must be float32, got {ops.dtype_name(x)}")
    spec = MergeSpec(dtype, dtype, d) if d and d % 32 == 0 and d <= 256 else None
    if spec is None:
        raise ValueError(f"merge_states on the GPU takes head_dim a multiple of 32 up to 256, got {d}")
    import cupy

    with cupy.cuda.Device(device):
        o_a, o_b, lse_a, lse_b = (ops.contiguous(x) for x in (o_a, o_b, lse_a, lse_b))
        out = ops.empty((b, n, h, d), o_a)
        lse = ops.empty((b, h, n), o_a, float32=True)
        if _api.POISON_OUTPUTS:
            ops.fill(out, math.nan)
            ops.fill(lse, math.nan)
        rows = b * n * h
        if rows:
            kernel = _kernels.get_kernel(spec, device)
            itemsize = 4 if dtype == "float32" else 2
            # Part 1 is read at a fixed element offset from part 0 (both arrays contiguous, same
            # shape; device allocations are aligned far beyond the element size).
            o_offset, lse_offset = ops.ptr(o_b) - ops.ptr(o_a), ops.ptr(lse_b) - ops.ptr(lse_a)
            assert o_offset % itemsize == 0 and lse_offset % 4 == 0
            kernel.launch(
                (-(-rows // MergeSpec.rows_per_block), 1, 1), (MergeSpec.num_threads, 1, 1), 0, ops.stream(device),
                ops.ptr(o_a), ops.ptr(lse_a), ops.ptr(out), ops.ptr(lse),
                o_offset // itemsize, n * h * d, h * d, d, lse_offset // 4, h * n, n,
                n * h * d, h * d, d, h * n, n, 2, b, n, h,
            )  # fmt: skip
    return out, lse
