"""Python mirror of ``AttnParams`` (kernels_cu/params.cuh), the by-value kernel argument.

The field list below is the single Python description of the struct: a NumPy structured dtype
(``align=True`` gives C's natural alignment) and a ``struct.Struct`` that packs one call's
values into the same bytes without building a NumPy scalar field by field (17 us measured on
the H200 for that, against ~1 us for one ``pack``). ``tests/test_params_layout.py`` compiles
``static_assert(offsetof(AttnParams, f) == ...)`` for every field against the C++ header.
"""

from __future__ import annotations

import struct

import numpy as np

# (name, NumPy type code); order and types exactly as in params.cuh.
ATTN_PARAMS_FIELDS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "u8"),
    ("k_ptr", "u8"),
    ("v_ptr", "u8"),
    ("o_ptr", "u8"),
    ("lse_ptr", "u8"),
    ("cu_seqlens_q", "u8"),
    ("cu_seqlens_k", "u8"),
    *((f"{t}_{s}_stride", "i8") for t in ("q", "k", "v", "o") for s in ("batch", "row", "head")),
    ("lse_batch_stride", "i8"),
    ("lse_head_stride", "i8"),
    ("batch", "i4"),
    ("seqlen_q", "i4"),
    ("seqlen_k", "i4"),
    ("h", "i4"),
    ("h_k", "i4"),
    ("h_h_k_ratio", "i4"),
    ("window_left", "i4"),
    ("window_right", "i4"),
    ("softmax_scale_log2", "f4"),
    ("softcap_prescale", "f4"),
)

ATTN_PARAMS_DTYPE = np.dtype(list(ATTN_PARAMS_FIELDS), align=True)

_STRUCT_CODES = {"u8": "Q", "i8": "q", "i4": "i", "f4": "f"}


def _struct_format(dtype: np.dtype) -> str:
    """Little-endian, unaligned format whose offsets match the aligned dtype (explicit padding)."""
    fields = dtype.fields
    assert fields is not None
    fmt, offset = "<", 0
    for name, code in ATTN_PARAMS_FIELDS:
        field_offset = fields[name][1]
        fmt += "x" * (field_offset - offset) + _STRUCT_CODES[code]
        offset = field_offset + np.dtype(code).itemsize
    return fmt + "x" * (dtype.itemsize - offset)


_PACKER = struct.Struct(_struct_format(ATTN_PARAMS_DTYPE))
assert _PACKER.size == ATTN_PARAMS_DTYPE.itemsize

# The packed bytes travel as one opaque void element: CuPy passes a size-1 NumPy array by value,
# reading it through __array_interface__, which for the structured dtype rebuilt the 30-field
# description on every call (~40 us measured on the H200, a third of a tiny call).
_OPAQUE = np.dtype((np.void, ATTN_PARAMS_DTYPE.itemsize))


def pack_attn_params_into(buffer: memoryview, *values: int | float) -> None:
    """Pack one call's field values into a caller-owned buffer (the direct-launch path)."""
    _PACKER.pack_into(buffer, 0, *values)


def pack_attn_params(*values: int | float) -> np.ndarray:
    """Pack one call's field values (in field order) into a size-1 array CuPy passes by value.
    ``.view(ATTN_PARAMS_DTYPE)`` reads the fields back."""
    return np.frombuffer(_PACKER.pack(*values), dtype=_OPAQUE)
