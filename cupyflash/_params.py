"""Python mirrors of the by-value kernel arguments: ``AttnParams`` (kernels_cu/params.cuh), the
Hopper kernel's ``Fa3Params`` after its tensor maps (kernels_cu/fa3_fwd.cu), and the decode
kernels' ``DecodeParams`` and ``MergeParams`` (kernels_cu/decode.cu), and the backward's
``BwdParams`` (kernels_cu/fa2_bwd.cu).

The field list below is the single Python description of the struct: a NumPy structured dtype
(``align=True`` gives C's natural alignment) and a ``struct.Struct`` that packs one call's
values into the same bytes without building a NumPy scalar field by field (17 us measured on
the H200 for that, against ~1 us for one ``pack``). ``tests/test_params_layout.py`` checks each
field list against its C++ struct with the compiler.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

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
    ("max_seqlen_q", "i4"),
    ("max_seqlen_k", "i4"),
    ("window_left", "i4"),
    ("window_right", "i4"),
    ("softmax_scale_log2", "f4"),
    ("softcap_prescale", "f4"),
    ("mod_score_scale", "f4"),
    ("dropout_seed", "u8"),
    ("dropout_threshold", "u4"),
    ("dropout_scale", "f4"),
    ("alibi_slopes", "u8"),
    ("alibi_batch_stride", "i8"),
    ("alibi_scale", "f4"),
    ("sinks", "u8"),
    ("seqused_k", "u8"),
    ("bias_ptr", "u8"),
    *((f"bias_{s}_stride", "i8") for s in ("batch", "head", "row", "key")),
    ("mask_cells", "u8"),
    *((f"mask_cells_{s}_stride", "i4") for s in ("batch", "head", "row", "key")),
    ("mask_cell_rows_log2", "i4"),
    ("mask_cell_keys_log2", "i4"),
    ("mask_heads", "i4"),
    ("mask_key_ranges", "u8"),
    ("mask_row_ranges", "u8"),
    *((f"mask_{t}_ranges_{s}_stride", "i4") for t in ("key", "row") for s in ("batch", "head")),
    ("error_flags", "u8"),
    *((f"mod_buffer{i}", "u8") for i in range(4)),
    *((f"mod_buffer{i}_stride{axis}", "i8") for i in range(4) for axis in range(2)),
)

_STRUCT_CODES = {"u8": "Q", "i8": "q", "i4": "i", "u4": "I", "f4": "f"}


class ParamsStruct:
    """One kernel-argument struct: its field list, its NumPy dtype (``align=True``: C's natural
    alignment) and a ``struct.Struct`` with explicit padding whose offsets match the dtype.

    The packed bytes travel as one opaque void element: CuPy passes a size-1 NumPy array by
    value, reading it through __array_interface__, which for a structured dtype rebuilt the
    30-field description on every call (~40 us measured on the H200, a third of a tiny call).
    """

    def __init__(self, c_name: str, fields: tuple[tuple[str, str], ...]) -> None:
        self.c_name = c_name
        self.fields = fields
        self.dtype = np.dtype(list(fields), align=True)
        layout = self.dtype.fields
        assert layout is not None
        fmt, offset = "<", 0
        for name, code in fields:
            fmt += "x" * (layout[name][1] - offset) + _STRUCT_CODES[code]
            offset = layout[name][1] + np.dtype(code).itemsize
        self._packer = struct.Struct(fmt + "x" * (self.dtype.itemsize - offset))
        assert self._packer.size == self.dtype.itemsize
        self._opaque = np.dtype((np.void, self.dtype.itemsize))
        self._slots = {field: i for i, (field, _) in enumerate(fields)}
        #: Per field, its index among the struct's 8-byte words where it is a pointer ("u8": 8-byte
        #: aligned by ``align=True``), else -1: where a call writes only pointers into a packed
        #: template (``_launch``), each is one store into the words, not a pack of every field.
        self.pointer_word = tuple(layout[name][1] // 8 if code == "u8" else -1 for name, code in fields)

    def pack_into(self, buffer: memoryview, values: Sequence[int | float]) -> None:
        """Pack one call's field values (in field order) into a caller-owned buffer (the
        direct-launch path)."""
        self._packer.pack_into(buffer, 0, *values)

    def pack_bytes(self, values: Sequence[int | float]) -> bytes:
        """The struct's bytes for ``values`` (a Launch's template, packed once per layout)."""
        return self._packer.pack(*values)

    def pack(self, *values: int | float) -> np.ndarray:
        """Pack one call's field values (in field order) into a size-1 array CuPy passes by
        value. ``.view(self.dtype)`` reads the fields back."""
        return np.frombuffer(self._packer.pack(*values), dtype=self._opaque)

    def template(self, **fixed: int | float) -> ParamsTemplate:
        """The struct's values for one plan: ``fixed`` fields by name, every other field 0 until
        a call sets it (pointers, per-call strides and scalars) through ``slot(name)``."""
        return ParamsTemplate(self, fixed)

    def slot(self, name: str) -> int:
        """Position of field ``name`` among the values ``pack`` takes."""
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"{self.c_name} has no field {name!r}") from None


class ParamsTemplate:
    """A params struct filled by name at plan time. A call copies ``values`` and sets the
    fields that change per call (pointers, per-call strides and scalars) at their slots."""

    __slots__ = ("struct", "values")

    def __init__(self, struct: ParamsStruct, fixed: dict[str, int | float]) -> None:
        self.struct = struct
        values: list[int | float] = [0] * len(struct.fields)
        for name, value in fixed.items():
            values[struct.slot(name)] = value
        self.values = tuple(values)

    def slot(self, name: str) -> int:
        return self.struct.slot(name)

    def value(self, name: str) -> int | float:
        return self.values[self.slot(name)]


# DecodeParams = { AttnParams attn; ... }: AttnParams' size is a multiple of 8 and the first
# field after it a pointer, so the flat list has the nested struct's layout.
DECODE_PARAMS_FIELDS: tuple[tuple[str, str], ...] = (
    *ATTN_PARAMS_FIELDS,
    ("cache_seqlens", "u8"),
    ("block_table", "u8"),
    ("k_new_ptr", "u8"),
    ("v_new_ptr", "u8"),
    ("o_partial_ptr", "u8"),
    ("lse_partial_ptr", "u8"),
    ("split_counters", "u8"),
    ("block_table_batch_stride", "i8"),
    *((f"{t}_new_{s}_stride", "i8") for t in ("k", "v") for s in ("batch", "row", "head")),
    ("seqlen_new", "i4"),
    ("page_size_log2", "i4"),
    ("num_pages", "i4"),
    ("cache_capacity", "i4"),
    ("num_splits", "i4"),
    ("blocks_per_split", "i4"),
    ("cache_batch_idx", "u8"),
    ("cache_leftpad", "u8"),
    ("cache_batch", "i4"),
    ("rotary_cos", "u8"),
    ("rotary_sin", "u8"),
    ("q_src_ptr", "u8"),
    *((f"q_src_{s}_stride", "i8") for s in ("batch", "row", "head")),
    ("rotary_half", "i4"),
    ("rotary_interleaved", "i4"),
    ("rotary_q_per_token", "i4"),
    ("rotary_max_cached", "i4"),
    ("k_scale_ptr", "u8"),
    ("v_scale_ptr", "u8"),
    ("k_scale", "f4"),
    ("v_scale", "f4"),
    ("k_scale_head_stride", "i4"),
    ("v_scale_head_stride", "i4"),
    ("kv_fp8", "i4"),
    ("tree_mask", "u8"),
    ("tree_mask_batch_stride", "i8"),
    ("tree_mask_row_stride", "i8"),
    ("prefix_block_table", "u8"),
    ("prefix_seqlens", "u8"),
    ("prefix_rows", "u8"),
    ("prefix_block_table_batch_stride", "i8"),
    ("prefix_seqlen", "i4"),
    ("prefix_capacity", "i4"),
    ("num_prefix_blocks", "i4"),
    ("prefix_splits", "i4"),
    ("prefix_blocks_per_split", "i4"),
)

MERGE_PARAMS_FIELDS: tuple[tuple[str, str], ...] = (
    ("o_parts_ptr", "u8"),
    ("lse_parts_ptr", "u8"),
    ("o_ptr", "u8"),
    ("lse_ptr", "u8"),
    *((f"o_{s}_stride", "i8") for s in ("part", "batch", "row", "head")),
    *((f"lse_{s}_stride", "i8") for s in ("part", "batch", "head")),
    *((f"out_{s}_stride", "i8") for s in ("batch", "row", "head")),
    ("out_lse_batch_stride", "i8"),
    ("out_lse_head_stride", "i8"),
    ("num_parts", "i4"),
    ("batch", "i4"),
    ("seqlen_q", "i4"),
    ("heads", "i4"),
)

# BwdParams = { AttnParams attn; ... } (kernels_cu/fa2_bwd.cu): nested first, as DecodeParams.
BWD_PARAMS_FIELDS: tuple[tuple[str, str], ...] = (
    *ATTN_PARAMS_FIELDS,
    ("do_ptr", "u8"),
    ("dq_ptr", "u8"),
    ("dk_ptr", "u8"),
    ("dv_ptr", "u8"),
    ("dq_accum", "u8"),
    ("neg_lse_log2", "u8"),
    ("dsum", "u8"),
    ("dlse_ptr", "u8"),
    ("dlse_batch_stride", "i8"),
    ("dlse_head_stride", "i8"),
    *((f"{t}_{s}_stride", "i8") for t in ("do", "dq", "dk", "dv") for s in ("batch", "row", "head")),
    ("row_batch_stride", "i8"),
    ("row_head_stride", "i8"),
    ("dq_scale", "f4"),
    ("dk_scale", "f4"),
    ("dq_tiled", "i4"),
    ("dq_semaphore", "u8"),
    ("dsink_rows", "u8"),
    ("grid_keys", "i4"),
    ("lpt_pairs", "i4"),
)

# Fa3Params = { TmaMap q_map, k_map, v_map; AttnParams attn; int32_t* tile_counters;
# int32_t num_m_blocks, lpt_pairs; Fa3Descale ... }: the launch buffer holds the maps apart
# (bytes 0-383); this list is what follows them.
FA3_PARAMS_FIELDS: tuple[tuple[str, str], ...] = (
    *ATTN_PARAMS_FIELDS,
    ("tile_counters", "u8"),
    ("num_m_blocks", "i4"),
    ("lpt_pairs", "i4"),
    # Fa3Descale q_descale, k_descale, v_descale (the FP8 forward): { ptr, batch_stride,
    # head_stride, value } each, flattened as <name>_ptr, <name>_batch_stride, ... and <name>.
    *(
        field
        for name in ("q_descale", "k_descale", "v_descale")
        for field in (
            (f"{name}_ptr", "u8"),
            (f"{name}_batch_stride", "i4"),
            (f"{name}_head_stride", "i4"),
            (name, "f4"),
        )
    ),
)

PARAMS_STRUCTS = {
    s.c_name: s
    for s in (
        ParamsStruct("AttnParams", ATTN_PARAMS_FIELDS),
        ParamsStruct("Fa3Params", FA3_PARAMS_FIELDS),
        ParamsStruct("DecodeParams", DECODE_PARAMS_FIELDS),
        ParamsStruct("MergeParams", MERGE_PARAMS_FIELDS),
        ParamsStruct("BwdParams", BWD_PARAMS_FIELDS),
        # Fa3BwdParams = { TmaMap q_map, k_map, v_map, do_map; BwdParams bwd; }: the maps apart
        # (bytes 0-511), then these fields.
        ParamsStruct("Fa3BwdParams", BWD_PARAMS_FIELDS),
    )
}

_ATTN = PARAMS_STRUCTS["AttnParams"]
ATTN_PARAMS_DTYPE = _ATTN.dtype
pack_attn_params_into = _ATTN.pack_into
pack_attn_params = _ATTN.pack
