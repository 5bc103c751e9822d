"""TMA tensor maps for the Hopper kernel, encoded by the driver's ``cuTensorMapEncodeTiled``.

Called through ctypes on ``libcuda`` (present wherever a GPU is), so no CUDA Python binding is
needed. A map holds the tensor's address, so it is built per call; the last maps are cached by
(address, shape, strides, box) because training and serving loops call again on the same
buffers, and a hit costs one dict lookup instead of a driver call (~2-5 us).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

MAP_BYTES = 128
# CU_TENSOR_MAP_DATA_TYPE_{FLOAT16, BFLOAT16, UINT8} and the element's bytes: float8 moves as bytes.
_DATA_TYPE = {"float16": (6, 2), "bfloat16": (9, 2), "float8": (0, 1)}
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3  # the layout wgmma reads with a 128-byte-swizzle descriptor
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0  # rows past the end read as zeros
_SWIZZLE_ROW_BYTES = 128  # a box's inner extent: one 128-byte swizzle row (64 16-bit elements)

_cache: dict[tuple[Any, ...], bytes] = {}
_MAX_CACHED = 1024


class TmaEncodeError(RuntimeError):
    """The driver rejected a tensor map (its CUresult is in the message)."""


@functools.cache
def _encode_fn() -> Any:
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


def tile_map(dtype: str, ptr: int, dims: Sequence[int], strides: Sequence[int], box_rows: int) -> bytes:
    """A 4-D map over (d, rows, heads, batch) -- ``dims`` in that order, innermost first --
    with element ``strides`` for (rows, heads, batch); boxes of one 128-byte row (64 16-bit
    elements, 128 float8) x ``box_rows`` x 1 x 1.

    Every stride must be a multiple of 16 bytes, the caller's layout check ensures it; the
    stride of an axis of size 1 is never used and is replaced by a legal one.
    """
    key = (dtype, ptr, *dims, *strides, box_rows)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    data_type, element_bytes = _DATA_TYPE[dtype]
    box_inner = _SWIZZLE_ROW_BYTES // element_bytes
    sizes = [max(int(n), 1) for n in dims]  # an empty axis: no load is ever issued
    byte_strides = [int(s) * element_bytes if n > 1 else 16 for s, n in zip(strides, sizes[1:], strict=True)]
    out = ctypes.create_string_buffer(MAP_BYTES + 64)
    address = (ctypes.addressof(out) + 63) & ~63  # the driver wants a 64-byte aligned map
    result = _encode_fn()(
        address, data_type, 4, ptr,
        (ctypes.c_uint64 * 4)(*sizes), (ctypes.c_uint64 * 3)(*byte_strides),
        (ctypes.c_uint32 * 4)(box_inner, box_rows, 1, 1), (ctypes.c_uint32 * 4)(1, 1, 1, 1),
        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO,
    )  # fmt: skip
    if result != 0:
        raise TmaEncodeError(
            f"cuTensorMapEncodeTiled failed (CUresult {result}) for dims {sizes}, byte strides {byte_strides}, "
            f"box {box_inner} x {box_rows}"
        )
    encoded = ctypes.string_at(address, MAP_BYTES)
    if len(_cache) >= _MAX_CACHED:
        _cache.clear()
    _cache[key] = encoded
    return encoded
