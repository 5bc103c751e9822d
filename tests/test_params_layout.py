"""The Python mirror of AttnParams has the C++ struct's exact layout (checked by the compiler)."""

from __future__ import annotations

import numpy as np

from cupyflash import _kernels, _source
from cupyflash._params import ATTN_PARAMS_DTYPE, ATTN_PARAMS_FIELDS, PARAMS_STRUCTS, pack_attn_params


def _compile(source: str, std: str = "c++20") -> None:
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(source, "layout_check.cu", [], [])
    options = [
        f"--std={std}",
        f"-I{_source.kernel_dir()}",
        *_source.cuda_include_options(),
        _kernels.arch_option("sm_90a"),
    ]
    try:
        nvrtc.compileProgram(program, options)
    except nvrtc.NVRTCError:
        raise AssertionError(nvrtc.getProgramLog(program)) from None


def _layout_check_source(fields) -> str:
    """Compile-time checks of AttnParams against a field list (NVRTC has no constant offsetof):
    the size, each field's size, and the field order -- C++20 designated initializers must
    follow declaration order. Natural alignment then fixes every offset; the GPU test
    test_gpu_fa2.py::test_params_offsets_on_device reads the real offsets back."""
    lines = ['#include "params.cuh"', f"static_assert(sizeof(AttnParams) == {ATTN_PARAMS_DTYPE.itemsize});"]
    for name, code in fields:
        lines.append(f'static_assert(sizeof(AttnParams::{name}) == {np.dtype(code).itemsize}, "{name}");')
    inits = ", ".join(f".{name} = {{}}" for name, _ in fields)
    lines.append(f"constexpr AttnParams kOrderProbe{{{inits}}};")
    lines.append('extern "C" __global__ void layout_check(AttnParams p) {}')
    return "\n".join(lines)


def test_params_struct_matches_python_fields():
    _compile(_layout_check_source(ATTN_PARAMS_FIELDS))


def test_layout_check_catches_a_swap():
    swapped = list(ATTN_PARAMS_FIELDS)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    try:
        _compile(_layout_check_source(swapped))
    except AssertionError as error:
        assert "designator" in str(error) or "initializ" in str(error)
    else:
        raise AssertionError("a field order swap went unnoticed")


def test_pack_round_trips_through_the_dtype():
    values = []
    for _, code in ATTN_PARAMS_FIELDS:
        values.append(1.5 if code == "f4" else (len(values) + 1) * (1 << 33 if code in ("u8", "i8") else 7))
    packed = pack_attn_params(*values)
    assert packed.shape == (1,) and packed.itemsize == ATTN_PARAMS_DTYPE.itemsize
    packed = packed.view(ATTN_PARAMS_DTYPE)
    for (name, _), value in zip(ATTN_PARAMS_FIELDS, values):
        assert packed[name][0] == value, name
    assert np.dtype(ATTN_PARAMS_DTYPE).itemsize % 8 == 0


def test_fa3_params_layout():
    """Fa3Params = three 128-byte tensor maps, then AttnParams at byte 384 (the launch buffer's
    layout in _kernels._LaunchScratch) and the tile-counter pointer right after it, and a size
    the buffer covers."""
    from cupyflash._tma import MAP_BYTES

    tail = PARAMS_STRUCTS["Fa3Params"]
    assert tail.fields[: len(ATTN_PARAMS_FIELDS)] == ATTN_PARAMS_FIELDS
    assert tail.dtype.fields["tile_counters"][1] == ATTN_PARAMS_DTYPE.itemsize
    attn_offset = 3 * MAP_BYTES
    padded = -(-(attn_offset + tail.dtype.itemsize) // 64) * 64
    _compile(
        '#include "fa3_fwd.cu"\n'
        f"static_assert(sizeof(TmaMap) == {MAP_BYTES} && alignof(TmaMap) == 64);\n"
        f"static_assert(sizeof(Fa3Params) == {padded});\n"
        "static_assert(sizeof(Fa3Params::tile_counters) == 8);\n"
        # no constant offsetof under NVRTC: three 128-byte maps end at 384, a multiple of
        # AttnParams' alignment, so that is where it starts; AttnParams' size is a multiple of
        # 8, so the pointer follows it with no padding (the assert on the dtype above)
        f"static_assert({attn_offset} % alignof(AttnParams) == 0);\n",
        std="c++17",
    )
    scratch = _kernels._scratch
    assert scratch.buffer.ctypes.data % 64 == 0 and scratch.buffer.nbytes >= padded


def test_decode_structs_match_python_fields():
    """DecodeParams (AttnParams nested first, then its own fields) and MergeParams, as above."""
    decode = PARAMS_STRUCTS["DecodeParams"]
    merge = PARAMS_STRUCTS["MergeParams"]
    own = decode.fields[len(ATTN_PARAMS_FIELDS) :]
    lines = [
        '#include "decode.cu"',
        f"static_assert(sizeof(DecodeParams) == {decode.dtype.itemsize});",
        f"static_assert(sizeof(MergeParams) == {merge.dtype.itemsize});",
        f"static_assert(sizeof(AttnParams) == {decode.dtype.fields[own[0][0]][1]});",  # own fields follow it
    ]
    for struct, fields in (("DecodeParams", own), ("MergeParams", merge.fields)):
        for name, code in fields:
            lines.append(f'static_assert(sizeof({struct}::{name}) == {np.dtype(code).itemsize}, "{name}");')
        first = ".attn = {}, " if struct == "DecodeParams" else ""
        inits = ", ".join(f".{name} = {{}}" for name, _ in fields)
        lines.append(f"constexpr {struct} kOrderProbe{struct}{{{first}{inits}}};")
    _compile("\n".join(lines))


def test_every_struct_packs_to_its_dtype():
    for layout in PARAMS_STRUCTS.values():
        values = [2.5 if code == "f4" else i + 1 for i, (_, code) in enumerate(layout.fields)]
        unpacked = layout.pack(*values).view(layout.dtype)
        assert [unpacked[name][0] for name, _ in layout.fields] == values, layout.c_name


def test_backward_struct_matches_python_fields():
    """BwdParams (AttnParams nested first, then its own fields), as DecodeParams above."""
    bwd = PARAMS_STRUCTS["BwdParams"]
    own = bwd.fields[len(ATTN_PARAMS_FIELDS) :]
    lines = [
        '#include "fa2_bwd.cu"',
        f"static_assert(sizeof(BwdParams) == {bwd.dtype.itemsize});",
        f"static_assert(sizeof(AttnParams) == {bwd.dtype.fields[own[0][0]][1]});",
    ]
    for name, code in own:
        lines.append(f'static_assert(sizeof(BwdParams::{name}) == {np.dtype(code).itemsize}, "{name}");')
    inits = ", ".join(f".{name} = {{}}" for name, _ in own)
    lines.append(f"constexpr BwdParams kOrderProbe{{.attn = {{}}, {inits}}};")
    _compile("\n".join(lines))


def test_hopper_backward_params_layout():
    """Fa3BwdParams = four 128-byte tensor maps, then BwdParams at byte 512: where the launch
    buffer puts the params struct (_kernels._LaunchScratch), the forward's three maps ending there too."""
    from cupyflash._tma import MAP_BYTES

    bwd = PARAMS_STRUCTS["BwdParams"]
    assert PARAMS_STRUCTS["Fa3BwdParams"].fields == bwd.fields
    offset = 4 * MAP_BYTES
    padded = -(-(offset + bwd.dtype.itemsize) // 64) * 64
    _compile(
        '#include "fa3_bwd.cu"\n'
        f"static_assert(sizeof(Fa3BwdParams) == {padded});\n"
        f"static_assert({offset} % alignof(BwdParams) == 0);\n",
        std="c++17",
    )
    scratch = _kernels._scratch
    assert scratch.maps_bytes == offset and scratch.buffer.nbytes >= padded
