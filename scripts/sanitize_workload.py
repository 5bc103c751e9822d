"""The program scripts/sanitize.py runs under compute-sanitizer: every kernel family once at
small shapes that reach every code path, through the public API only.

    python scripts/sanitize_workload.py [--size tiny|small] [--lib cupy|torch|numpy]

Paths reached: partial query and key tiles (lengths 1, 70, 97, 200, never a multiple of a
block), the causal diagonal with Nq = Nk and Nq != Nk (rows that see no key), sliding windows,
softcap, a negative scale, GQA and MQA, bhsd and a strided head slice; FA2 (every head dim at
``small``) and the Hopper kernel forced with ``algorithm=``, the FA1 and naive baselines; packed
sequences with empty and one-token ones; KV caches contiguous and paged (page sizes 1, 16, 256),
split counts 1, 3 and automatic, appended tokens; merge_states with an empty part; the backward
(atomic and deterministic dQ, dense and packed); head dims below a tile width (``headdim``).

``tiny`` (racecheck, synccheck: they are slow) keeps two head dims and short lengths; ``small``
(memcheck, initcheck) runs every head dim. On the GPU, CuPy's memory pool is bypassed
(``cupy.cuda.set_allocator(None)``: each buffer its own allocation, so an overrun lands outside
it) and PyTorch must run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (sanitize.py sets it).
``--lib numpy`` runs the same calls on host arrays (float32) with no GPU: a smoke test of the
workload itself (tests/test_scripts.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

import cupyflash

# The head dims of each kernel family (cupyflash/_specs.py; public numbers, so that the
# workload needs no private module).
FA2_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
FA3_HEAD_DIMS = (64, 128, 256)
FA1_HEAD_DIMS = (64, 128, 256, 512)
DECODE_HEAD_DIMS = (64, 128, 256)
BWD_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


class Arrays:
    """Inputs in one library (CuPy or torch on the GPU, NumPy on the host), fresh random data."""

    def __init__(self, lib: str, seed: int = 0) -> None:
        self.lib = lib
        self.rng = np.random.default_rng(seed)
        if lib == "cupy":
            import cupy

            cupy.cuda.set_allocator(None)  # no pool: every buffer is its own allocation
            cupy.cuda.set_pinned_memory_allocator(None)
            self.module = cupy
        elif lib == "torch":
            import torch

            self.module = torch
        else:
            self.module = np

    def randn(self, *shape: int, dtype: str = "float16") -> Any:
        host = self.rng.standard_normal(shape).astype(np.float32)
        if self.lib == "cupy" and dtype != "bfloat16":
            return self.module.asarray(host).astype(dtype)
        if self.lib != "numpy":  # CuPy's bfloat16 arrays come from torch through DLPack (NOTES.md)
            import torch

            tensor = torch.from_numpy(host).to("cuda", getattr(torch, dtype))
            return self.module.from_dlpack(tensor) if self.lib == "cupy" else tensor
        return host  # the host path runs float32 (NumPy has no bfloat16 array-API namespace)

    def fp8_bytes(self, *shape: int) -> Any:
        """Random finite float8 bytes of either format (below 0x70 in magnitude: no e4m3 NaN, no
        e5m2 infinity or NaN), as the uint8 arrays a cache of kv_dtype holds."""
        return self.ints(self.rng.integers(0, 0x70, shape) | (self.rng.integers(0, 2, shape) << 7), np.uint8)

    def ints(self, values: Any, dtype: Any = np.int32) -> Any:
        host = np.asarray(values, dtype=dtype)
        if self.lib == "cupy":
            return self.module.asarray(host)
        if self.lib == "torch":
            return self.module.from_numpy(host).cuda()
        return host

    def bools(self, values: Any, shape: tuple[int, ...]) -> Any:
        host = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=bool), shape))
        if self.lib == "cupy":
            return self.module.asarray(host)
        if self.lib == "torch":
            return self.module.from_numpy(host).cuda()
        return host

    def full_like(self, x: Any, value: float) -> Any:
        if self.lib == "cupy" and str(x.dtype) == "bfloat16":  # through torch, as randn
            import torch

            return self.module.from_dlpack(torch.full_like(torch.from_dlpack(x), value))
        return self.module.full_like(x, value)

    def sync(self) -> None:
        if self.lib == "cupy":
            self.module.cuda.Device().synchronize()
        elif self.lib == "torch":
            self.module.cuda.synchronize()


def _hopper(lib: str) -> bool:
    if lib == "numpy":
        return True  # the host maps "fa3" to its FA2: the calls are valid there too
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


Case = tuple[str, Callable[[Arrays], Any]]


def _attention(
    a: Arrays, b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: str = "bfloat16", alibi: bool = False,
    **options: Any,
) -> Any:  # fmt: skip
    q, k, v = (
        a.randn(b, sq, hq, d, dtype=dtype),
        a.randn(b, sk, hkv, d, dtype=dtype),
        a.randn(b, sk, hkv, d, dtype=dtype),
    )
    if alibi:  # (B, Hq) slopes
        options["alibi_slopes"] = a.randn(b, hq, dtype="float32")
    _add_mask(a, options, b, hq, sq, sk, dtype)
    _add_variants(a, options, hq, sk)
    return cupyflash.attention(q, k, v, return_lse=True, **options)


def _add_mask(a: Arrays, options: dict[str, Any], b: int, hq: int, sq: int, sk: int, dtype: str) -> None:
    """options["mask"] -> an attn_mask: "key-padding" (B, 1, 1, Nk), the first third of the keys
    hidden; "additive" (1, Hq, Nq, Nk) in q's dtype; "blocks" (1, 1, Nq, Nk) boolean, 32 x 32
    blocks hiding every key, showing every key or random (the kernels skip the first kind)."""
    mask = options.pop("mask", None)
    if mask == "key-padding":
        options["attn_mask"] = a.bools(np.arange(sk)[None, None, None, :] >= sk // 3, (b, 1, 1, sk))
    elif mask == "additive":
        options["attn_mask"] = a.randn(1, hq, sq, sk, dtype=dtype)
    elif mask == "blocks":
        states = np.kron(a.rng.integers(0, 3, (-(-sq // 32), -(-sk // 32))), np.ones((32, 32), dtype=int))[:sq, :sk]
        keep = np.where(states == 2, a.rng.random((sq, sk)) < 0.5, states == 1)
        options["attn_mask"] = a.bools(keep, (1, 1, sq, sk))


def _layouts(a: Arrays, nq: int, nk: int, d: int) -> Any:
    q, k, v = (a.randn(1, 2, n, d) for n in (nq, nk, nk))  # bhsd
    cupyflash.attention(q, k, v, layout="bhsd", causal=True)
    heads = a.randn(1, nq, 8, d)[:, :, ::2]  # a head slice: strided rows and heads
    return cupyflash.attention(heads, a.randn(1, nk, 2, d), a.randn(1, nk, 2, d), causal=True)


def attention_cases(size: str, hopper: bool) -> Iterator[Case]:
    fa2_dims = (64, 128) if size == "tiny" else FA2_HEAD_DIMS
    fa3_dims = ((64, 128) if size == "tiny" else FA3_HEAD_DIMS) if hopper else ()
    nq, nk = (70, 97) if size == "tiny" else (97, 200)
    # (label, B, Nq, Nk, Hq, Hkv, options): partial tiles, the causal diagonal with Nq = Nk,
    # rows that see no key (Nq > Nk, causal), windows, softcap, MQA, a negative scale.
    shapes = [
        ("causal-gqa", 1, nq, nk, 4, 2, {"causal": True}),
        ("causal-square", 1, nk, nk, 2, 2, {"causal": True}),
        ("causal-nq>nk-mqa", 2, nk, nq, 2, 1, {"causal": True}),
        ("window", 1, nq, nk, 2, 1, {"window": (16, 8)}),
        ("softcap-causal", 1, nq, nk, 2, 2, {"causal": True, "softcap": 30.0}),
        ("one-query", 1, 1, nk, 4, 1, {"causal": True, "scale": -0.2}),
    ]
    dropout = [  # FA2 only
        ("dropout-causal", 1, nq, nk, 4, 2, {"causal": True, "dropout_p": 0.3, "seed": 5}),
        ("alibi-window", 2, nq, nk, 4, 2, {"window": (20, 5), "alibi": True}),
        ("alibi-softcap-causal", 1, nq, nk, 4, 2, {"causal": True, "softcap": 5.0, "alibi": True}),
        ("mask-padding-causal", 2, nq, nk, 4, 2, {"causal": True, "mask": "key-padding"}),
        ("mask-additive-window", 1, nq, nk, 4, 2, {"window": (20, 5), "mask": "additive"}),
        ("mask-blocks", 2, nq, nk, 4, 2, {"mask": "blocks"}),
        # 128 keys: 16-byte mask rows, the mixed tiles staged through shared memory
        ("mask-blocks-staged", 2, nq, 128, 4, 2, {"mask": "blocks"}),
        ("mask-additive-staged-causal", 1, nq, 128, 4, 2, {"causal": True, "mask": "additive"}),
    ]
    for algorithm, dims in (("fa2", fa2_dims), ("fa3", fa3_dims)):
        for d in dims:
            for label, b, sq, sk, hq, hkv, options in shapes + (dropout if algorithm == "fa2" else []):
                for dtype in ("float16", "bfloat16") if label == "causal-gqa" else ("bfloat16",):
                    call = partial(
                        _attention, b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dtype=dtype, algorithm=algorithm, **options
                    )
                    yield f"attention {algorithm} d={d} {dtype} {label}", call
    yield f"attention layouts d={fa2_dims[0]}", partial(_layouts, nq=nq, nk=nk, d=fa2_dims[0])
    for algorithm, dims in (("fa1", (64, 128) if size == "tiny" else FA1_HEAD_DIMS), ("naive", (64, 80))):
        for d in dims:
            for causal in (False, True):
                call = partial(_attention, b=1, sq=nq, sk=nk, hq=4, hkv=2, d=d, algorithm=algorithm, causal=causal)
                yield f"attention {algorithm} d={d} causal={causal}", call


def _varlen(a: Arrays, q_lens: list[int], k_lens: list[int], d: int, **options: Any) -> Any:
    cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
    q = a.randn(int(cu_q[-1]) + 3, 4, d)  # 3 rows after the last sequence
    k, v = a.randn(int(cu_k[-1]), 2, d), a.randn(int(cu_k[-1]), 2, d)
    return cupyflash.attention_varlen(
        q, k, v, a.ints(cu_q), a.ints(cu_k), max(q_lens), max(k_lens), return_lse=True, **options
    )


def _paged_varlen(a: Arrays, q_lens: list[int], k_lens: list[int], d: int, page_size: int, **options: Any) -> Any:
    """Packed sequences over shuffled pages (attention_varlen's block_table), two spare pages."""
    cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
    width = max(-(-n // page_size) for n in k_lens)
    pages = len(k_lens) * width + 2
    k, v = a.randn(pages, page_size, 2, d), a.randn(pages, page_size, 2, d)
    table = a.ints(a.rng.permutation(pages)[: len(k_lens) * width].reshape(len(k_lens), width))
    q = a.randn(int(cu_q[-1]) + 3, 4, d)  # 3 rows after the last sequence
    return cupyflash.attention_varlen(
        q, k, v, a.ints(cu_q), a.ints(cu_k), max(q_lens), max(k_lens), block_table=table, return_lse=True, **options
    )


def varlen_cases(size: str, hopper: bool) -> Iterator[Case]:
    # empty and one-token sequences, Nq != Nk, one longer than a tile
    lengths = ([0, 1, 37, 70], [5, 1, 0, 97]) if size == "tiny" else ([0, 1, 37, 130, 1], [5, 1, 0, 200, 64])
    for algorithm in ("fa2", "fa3") if hopper else ("fa2",):
        for d in (64, 128):
            for options in ({"causal": True}, {"window": (20, -1)}, {}):
                yield (
                    f"varlen {algorithm} d={d} {options}",
                    partial(_varlen, q_lens=lengths[0], k_lens=lengths[1], d=d, algorithm=algorithm, **options),
                )
    for page_size in (1, 16, 256):
        for d in (64, 80, 128):
            yield (
                f"varlen paged page={page_size} d={d}",
                partial(_paged_varlen, q_lens=lengths[0], k_lens=lengths[1], d=d, page_size=page_size, causal=True),
            )


def _kvcache(
    a: Arrays, length: int, cached: list[int], d: int, page_size: int | None, num_splits: int, nq: int, new: int,
    **options: Any,
) -> Any:  # fmt: skip
    b, hq, hkv = len(cached), 8, 2
    if options.pop("alibi", False):  # (Hq,) slopes
        options["alibi_slopes"] = a.randn(hq, dtype="float32")
    if options.pop("rotary", False):  # half the head dim rotated, GPT-NeoX pairs
        capacity = length if page_size is None else -(-length // page_size) * page_size
        options.update(rotary_cos=a.randn(capacity, d // 4), rotary_sin=a.randn(capacity, d // 4))
        options["rotary_interleaved"] = False
    _add_variants(a, options, hq, nq)
    fmt = options.pop("fp8", None)  # a float8 cache of this format, uint8 bytes
    cache = a.fp8_bytes if fmt else a.randn
    if fmt:
        options.update(kv_dtype=fmt, k_scale=0.5, v_scale=0.25)
    extra = {}
    if new:
        extra = {"k_new": a.randn(b, new, hkv, d), "v_new": a.randn(b, new, hkv, d)}
    if page_size is None:
        entries = b + 1 if options.pop("batch_idx", False) else b  # cache_batch_idx: a spare entry
        k, v = cache(entries, length, hkv, d), cache(entries, length, hkv, d)
        if entries > b:  # its duplicate check reads every entry named
            options["cache_batch_idx"] = a.ints(a.rng.permutation(entries)[:b])
    else:  # pages in shuffled order, two spare ones
        per_seq = -(-length // page_size)
        pages = b * per_seq + 2
        k, v = cache(pages, page_size, hkv, d), cache(pages, page_size, hkv, d)
        extra["block_table"] = a.ints(a.rng.permutation(pages)[: b * per_seq].reshape(b, per_seq))
    return cupyflash.attention_with_kvcache(
        a.randn(b, nq, hq, d), k, v, cache_seqlens=a.ints(cached), num_splits=num_splits, causal=True,
        return_lse=True, **extra, **options,
    )  # fmt: skip


def kvcache_cases(size: str) -> Iterator[Case]:
    length = 300 if size == "tiny" else 1031
    cached = [0, 1, length // 2, length - 8]  # empty, one token, ragged, nearly full
    for d in (64, 128) if size == "tiny" else DECODE_HEAD_DIMS:
        for page_size in (None, 1, 16, 256):
            for splits in (1, 3, 0):
                for nq, new in ((1, 1), (4, 4), (3, 0)):
                    call = partial(
                        _kvcache,
                        length=length,
                        cached=cached,
                        d=d,
                        page_size=page_size,
                        num_splits=splits,
                        nq=nq,
                        new=new,
                    )
                    yield f"kvcache d={d} page={page_size} splits={splits} nq={nq} new={new}", call
        for nq in (1, 37):  # cache_batch_idx with an append (the decode kernel, FA2 over the cache)
            call = partial(_kvcache, length=length, cached=[0, 1, length // 2, length - 40], d=d, page_size=None,
                           num_splits=0, nq=nq, new=nq, batch_idx=True)  # fmt: skip
            yield f"kvcache d={d} batch_idx nq={nq}", call
        for page_size in (None, 1, 16) if d in (64, 128) else ():  # float8 caches, either format
            for fmt, nq in (("e4m3", 1), ("e5m2", 4)):
                call = partial(_kvcache, length=length, cached=cached, d=d, page_size=page_size, num_splits=0, nq=nq,
                               new=nq, fp8=fmt)  # fmt: skip
                yield f"kvcache fp8 {fmt} d={d} page={page_size} nq={nq}", call
        for page_size in (None, 1):  # a window (its key blocks skipped) with softcap
            call = partial(_kvcache, length=length, cached=cached, d=d, page_size=page_size, num_splits=0, nq=3,
                           new=3, window=(70, -1), softcap=4.0)  # fmt: skip
            yield f"kvcache d={d} page={page_size} window softcap", call
        for page_size in (None, 1, 16, 256):  # past 16 query tokens, and ALiBi: the FA2 kernel over the cache
            few = [0, 1, length // 2, length - 40]
            call = partial(_kvcache, length=length, cached=few, d=d, page_size=page_size, num_splits=0, nq=37,
                           new=37)  # fmt: skip
            yield f"kvcache fa2 d={d} page={page_size} nq=37 new=37", call
            call = partial(_kvcache, length=length, cached=cached, d=d, page_size=page_size, num_splits=0, nq=1,
                           new=1, alibi=True, softcap=4.0 if page_size == 16 else 0.0)  # fmt: skip
            yield f"kvcache fa2 d={d} page={page_size} alibi", call
            for nq in (2, 37):  # rotary: the append rotates k_new, a kernel rotates q
                call = partial(_kvcache, length=length, cached=few, d=d, page_size=page_size, num_splits=0, nq=nq,
                               new=nq, rotary=True)  # fmt: skip
                yield f"kvcache rotary d={d} page={page_size} nq={nq}", call


def _backward(a: Arrays, nq: int, nk: int, d: int, deterministic: bool, alibi: bool = False, **options: Any) -> Any:
    q, k, v = a.randn(2, nq, 4, d), a.randn(2, nk, 2, d), a.randn(2, nk, 2, d)
    if alibi:  # (Hq,) slopes
        options["alibi_slopes"] = a.randn(4, dtype="float32")
    _add_mask(a, options, 2, 4, nq, nk, "float16")
    _add_variants(a, options, 4, nk)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
    dout = a.randn(2, nq, 4, d)
    return cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)


def _varlen_backward(a: Arrays, q_lens: list[int], k_lens: list[int], d: int, deterministic: bool) -> Any:
    cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
    q = a.randn(int(cu_q[-1]) + 3, 4, d)  # 3 rows after the last sequence
    k, v = a.randn(int(cu_k[-1]), 2, d), a.randn(int(cu_k[-1]), 2, d)
    args = (a.ints(cu_q), a.ints(cu_k), max(q_lens), max(k_lens))
    out, lse = cupyflash.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    dout = a.randn(*q.shape)
    return cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True, deterministic=deterministic)


def backward_cases(size: str) -> Iterator[Case]:
    """The backward's kernels (prep, key blocks with atomic dQ or the deterministic dQ blocks; on
    Hopper its own key-block kernel where it has the variant): partial tiles, causal rows that see
    no key, a window with and without softcap, dropout, ALiBi (with softcap too), GQA, packed sequences."""
    nq, nk = (70, 97) if size == "tiny" else (97, 200)
    for d in (64, 128) if size == "tiny" else BWD_HEAD_DIMS:
        for deterministic in (False, True):
            dropout = {"causal": True, "dropout_p": 0.3, "seed": 9}
            alibi = {"causal": True, "alibi": True}
            alibi_softcap = {"window": (30, 5), "softcap": 4.0, "alibi": True}
            blocks = {"mask": "blocks"}
            windows = ({"window": (30, 5)}, {"window": (30, 5), "softcap": 4.0})  # Hopper's, FA2's
            for options in ({"causal": True}, *windows, dropout, alibi, alibi_softcap, blocks):
                label = f"backward d={d} det={deterministic} {options}"
                yield label, partial(_backward, nq=nq, nk=nk, d=d, deterministic=deterministic, **options)
            yield (
                f"backward causal nq>nk d={d} det={deterministic}",
                partial(_backward, nq=nk, nk=nq, d=d, deterministic=deterministic, causal=True),
            )
            yield (
                f"varlen backward d={d} det={deterministic}",
                partial(
                    # (the fifth: several query steps and key blocks, whose loads run into the
                    # neighbours' rows on Hopper)
                    _varlen_backward,
                    q_lens=[0, 1, 37, 70, 150, 9],
                    k_lens=[5, 1, 0, 97, 300, 20],
                    d=d,
                    deterministic=deterministic,
                ),
            )
            # Key blocks adding into each dQ tile in turn (Hopper, deterministic): 4-12 of them.
            long_k = 4 * nk + 100
            for causal in (False, True):
                yield (
                    f"backward many key blocks causal={causal} d={d} det={deterministic}",
                    partial(_backward, nq=nq, nk=long_k, d=d, deterministic=deterministic, causal=causal),
                )


def tail_head_dim_cases(size: str, hopper: bool) -> Iterator[Case]:
    """Head dims below a tile width (columns past the caller's zero in shared memory, never
    touched in global memory): multiples of 8 in 16-byte chunks (40, 80, 224; the Hopper kernel
    too), others element by element (59); forward, backward, varlen, decode with an append."""
    nq, nk = (70, 97) if size == "tiny" else (97, 200)
    for d in (59, 80) if size == "tiny" else (40, 59, 80, 224):
        for algorithm in ("fa2", "fa3") if hopper and d % 8 == 0 else ("fa2",):
            for options in ({"causal": True}, {"window": (16, 8), "softcap": 5.0}):
                call = partial(_attention, b=2, sq=nq, sk=nk, hq=4, hkv=2, d=d, algorithm=algorithm, **options)
                yield f"headdim attention {algorithm} d={d} {options}", call
        for deterministic in (False, True):
            call = partial(_backward, nq=nq, nk=nk, d=d, deterministic=deterministic, causal=True)
            yield f"headdim backward d={d} det={deterministic}", call
        call = partial(_varlen, q_lens=[0, 1, 37, 70], k_lens=[5, 1, 0, 97], d=d, causal=True)
        yield f"headdim varlen d={d}", call
        for page_size in (None, 1, 16):
            call = partial(_kvcache, length=300, cached=[0, 1, 150, 290], d=d, page_size=page_size, num_splits=0,
                           nq=2, new=2)  # fmt: skip
            yield f"headdim kvcache d={d} page={page_size}", call


def _merge(a: Arrays, dtype: str, d: int) -> Any:
    o_a, o_b = a.randn(2, 37, 4, d, dtype=dtype), a.randn(2, 37, 4, d, dtype=dtype)
    lse_a, lse_b = a.randn(2, 4, 37, dtype="float32"), a.randn(2, 4, 37, dtype="float32")
    cupyflash.merge_states(o_a, lse_a, o_b, lse_b)
    return cupyflash.merge_states(o_a, lse_a, a.full_like(o_b, np.nan), a.full_like(lse_b, -np.inf))  # an empty part


def merge_cases(size: str) -> Iterator[Case]:
    for dtype in ("float16", "bfloat16", "float32"):
        for d in (64, 128):
            yield f"merge_states {dtype} d={d}", partial(_merge, dtype=dtype, d=d)


def _shared_prefix(a: Arrays, prefix: int, own: list[int], page_size: int, d: int) -> Any:
    """Cascade decoding: a prefix of ``prefix`` keys shared by every request (split into key
    ranges on the GPU), each request's own pages after it, one appended token."""
    b, hq, hkv = len(own), 8, 2
    own_pages = [-(-(n + 1) // page_size) for n in own]
    prefix_pages = -(-prefix // page_size)
    pages = prefix_pages + sum(own_pages)
    k, v = a.randn(pages, page_size, hkv, d), a.randn(pages, page_size, hkv, d)
    order = a.rng.permutation(pages)
    own_rows, start = [], prefix_pages
    for n in own_pages:
        own_rows.append(list(order[start : start + n]) + [0] * (max(own_pages) - n))
        start += n
    return cupyflash.attention_with_shared_prefix(
        a.randn(b, 1, hq, d), k, v, prefix_block_table=a.ints([order[:prefix_pages]]), prefix_seqlens=prefix,
        block_table=a.ints(own_rows), cache_seqlens=a.ints(own), k_new=a.randn(b, 1, hkv, d),
        v_new=a.randn(b, 1, hkv, d), return_lse=True,
    )  # fmt: skip


def cascade_cases(size: str) -> Iterator[Case]:
    for page_size in (1, 16):
        call = partial(_shared_prefix, prefix=4096 if size != "tiny" else 2100, own=[5, 0, 40], page_size=page_size,
                       d=128)  # fmt: skip
        yield f"shared prefix page={page_size}", call


def _sinks(a: Arrays, hq: int) -> Any:
    return a.randn(hq, dtype="float32")


def _score_functions(a: Arrays, n: int, implied: bool = False, mask_only: bool = False) -> dict[str, Any]:
    """A document mask over a captured id array (three documents, odd lengths) and a softcap;
    ``implied``: the mask also hides keys 64 to 127 (a whole 64-key cell for every row), so the
    call hands the kernels the summary the mask implies (_block_mask.implied), where without it
    every cell is the array's (the kernels class tiles themselves, or not at all); ``mask_only``:
    the mask alone (its backward the Hopper one's hook, where it has one)."""
    doc_id = a.ints(np.repeat(np.arange(3), [n // 3, n // 3 + 1, n - 2 * (n // 3) - 1]))

    def same_document(b, h, q_idx, kv_idx):
        return doc_id[q_idx] == doc_id[kv_idx]

    def same_document_past_a_gap(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx // 64 != 1)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * cupyflash.mods.tanh(score / 20.0)

    mask = same_document_past_a_gap if implied else same_document
    return {"mask_mod": mask} if mask_only else {"mask_mod": mask, "score_mod": softcap}


def _tree(a: Arrays, nq: int) -> Any:
    """Draft token i sees itself and its parent chain in a binary tree (parent (i - 1) // 2)."""
    sees = np.eye(nq, dtype=bool)
    for i in range(1, nq):
        sees[i] |= sees[(i - 1) // 2]
    return a.bools(sees, (nq, nq))


def _add_variants(a: Arrays, options: dict[str, Any], hq: int, n: int) -> None:
    """options["sinks"] -> (Hq,) float32 sinks; options["mods"] -> the score functions over ``n``
    tokens ("implied", "mask", both "implied-mask": as _score_functions says); options["tree"] -> a tree mask over the
    ``n`` query tokens."""
    if options.pop("sinks", False):
        options["sinks"] = a.randn(hq, dtype="float32")
    mods = options.pop("mods", False)
    if mods:
        implied, mask_only = mods in ("implied", "implied-mask"), mods in ("mask", "implied-mask")
        options.update(_score_functions(a, n, implied=implied, mask_only=mask_only))
    if options.pop("tree", False):
        options["tree_mask"] = _tree(a, n)


def _varlen_score_functions(a: Arrays, q_lens: list[int]) -> dict[str, Any]:
    """Over packed sequences: a bias by distance from each sequence's end (a read outside its
    table at the rows past a sequence that the tiles cover) and a per-sequence prefix mask."""
    lens = a.ints(np.array(q_lens))
    prefix = a.ints(np.array([3 * i for i in range(len(q_lens))]))
    rev = a.randn(4, max(q_lens), dtype="float32")

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + rev[h, lens[b] - 1 - q_idx]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])

    return {"score_mod": from_the_end, "mask_mod": prefix_lm}


def _varlen_mods(a: Arrays, q_lens: list[int], k_lens: list[int], d: int, algorithm: str, backward: bool) -> Any:
    cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
    q = a.randn(int(cu_q[-1]) + 3, 4, d)  # 3 rows after the last sequence
    k, v = a.randn(int(cu_k[-1]), 2, d), a.randn(int(cu_k[-1]), 2, d)
    args = (a.ints(cu_q), a.ints(cu_k), max(q_lens), max(k_lens))
    mods = _varlen_score_functions(a, q_lens)
    out, lse = cupyflash.attention_varlen(q, k, v, *args, algorithm=algorithm, return_lse=True, **mods)
    if not backward:
        return out, lse
    dout = a.randn(*q.shape)
    return cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, *args, **mods)


def variant_cases(size: str, hopper: bool) -> Iterator[Case]:
    """Learnable sinks (forwards, backward, decode with one split and many), score and mask
    functions compiled into the forwards and the backward, and tree masks in the decode kernel."""
    nq, nk = (70, 97) if size == "tiny" else (97, 200)
    length = 300 if size == "tiny" else 1031
    for d in (64, 128):
        for algorithm in ("fa2", "fa3") if hopper else ("fa2",):
            call = partial(_attention, b=2, sq=nq, sk=nk, hq=4, hkv=2, d=d, algorithm=algorithm, causal=True,
                           sinks=True)  # fmt: skip
            yield f"variant sinks attention {algorithm} d={d}", call
            for mods in (True, "implied", "implied-mask"):  # (a mask alone: no code on plain tiles)
                call = partial(_attention, b=1, sq=nk, sk=nk, hq=4, hkv=2, d=d, algorithm=algorithm, mods=mods)
                label = "" if mods is True else f"-{mods}"
                yield f"variant mods{label} attention {algorithm} d={d}", call
        lengths = ([0, 1, 37, 70, 9], [5, 1, 0, 97, 20]) if size == "tiny" else ([0, 1, 37, 150, 9], [5, 1, 0, 300, 20])
        for algorithm in ("fa2", "fa3") if hopper else ("fa2",):
            call = partial(_varlen_mods, q_lens=lengths[0], k_lens=lengths[1], d=d, algorithm=algorithm,
                           backward=algorithm == "fa2")  # fmt: skip
            yield f"variant mods varlen {algorithm} d={d}", call
        for deterministic in (False, True):
            call = partial(_backward, nq=nq, nk=nk, d=d, deterministic=deterministic, causal=True, sinks=True)
            yield f"variant sinks backward d={d} det={deterministic}", call
            for mods in (True, "implied", "mask", "implied-mask"):  # (the last: the Hopper one's, classed)
                call = partial(_backward, nq=nk, nk=nk, d=d, deterministic=deterministic, mods=mods)
                label = "" if mods is True else f"-{mods}"
                yield f"variant mods{label} backward d={d} det={deterministic}", call
        for page_size in (None, 16):
            for splits in (1, 0):
                call = partial(_kvcache, length=length, cached=[0, 1, length // 2, length - 8], d=d,
                               page_size=page_size, num_splits=splits, nq=2, new=2, sinks=True)  # fmt: skip
                yield f"variant sinks kvcache d={d} page={page_size} splits={splits}", call
            for drafts in (5, 16):
                call = partial(_kvcache, length=length, cached=[0, 1, length // 2, length - 20], d=d,
                               page_size=page_size, num_splits=0, nq=drafts, new=drafts, tree=True)  # fmt: skip
                yield f"variant tree kvcache d={d} page={page_size} drafts={drafts}", call


def cases(size: str = "small", hopper: bool = True) -> list[Case]:
    """Every call of the workload, in order: (label, fn(arrays))."""
    return [
        *attention_cases(size, hopper),
        *varlen_cases(size, hopper),
        *kvcache_cases(size),
        *merge_cases(size),
        *cascade_cases(size),
        *backward_cases(size),
        *tail_head_dim_cases(size, hopper),
        *variant_cases(size, hopper),
    ]


def run(lib: str = "cupy", size: str = "small", only: str | None = None, skip: str | None = None) -> int:
    """Run every case (those whose label contains ``only``, less those that contain ``skip``);
    returns the number run. A filter that matches no case of ``size`` is an error: a sanitizer
    run over no call would report 0 errors."""
    arrays = Arrays(lib)
    todo = [
        (label, fn)
        for label, fn in cases(size, _hopper(lib))
        if (only is None or only in label) and (skip is None or skip not in label)
    ]
    if not todo:
        raise SystemExit(f"sanitize workload: no {size} case matches only={only!r}, skip={skip!r}")
    start = time.perf_counter()
    for i, (label, fn) in enumerate(todo, start=1):
        print(f"[{i}/{len(todo)}] {label}", flush=True)
        fn(arrays)
        arrays.sync()
    print(f"sanitize workload: {len(todo)} calls ({size}, {lib}) in {time.perf_counter() - start:.1f} s", flush=True)
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--lib", choices=("cupy", "torch", "numpy"), default="cupy")
    parser.add_argument("--only", help="only the cases whose label contains this")
    parser.add_argument("--skip", help="not the cases whose label contains this")
    args = parser.parse_args(argv)
    run(args.lib, args.size, args.only, args.skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
