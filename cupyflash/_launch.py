"""``run(launch, lib, device, arrays)``: the one place a GPU call meets the device.

It owns the device guard, the operands' pointers and strides (copies where the kernels cannot
read an array as it is; never of an array the kernels write), the outputs (allocated in the
caller's library; NaN-poisoned in tests), the caller's stream, the per-stream scratch, and the
launches. Everything that does not depend on the arrays' addresses was decided by the plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _interop, _kernels, _tma, _workspace
from ._interop import ArrayLib
from ._plan import CONTIGUOUS, FP8_TILE, LENGTHS, SCALAR, TILE, KernelStep, Launch, Operand, TmaMaps
from ._validate import check_int_seqlens, check_rotary_positions

# The empty mapping: ``given`` of a call that lets the plan allocate every output, and the
# temporaries of a plan that has none (one shared object, no allocation per call).
EMPTY: Mapping[str, Any] = {}

#: Fill every GPU output with NaN before the launch (tests set it: a value the kernel fails to
#: write then shows up as NaN instead of as stale memory that happens to look right).
POISON_OUTPUTS = False
POISON_BYTE = 0x7F  # a byte output's poison: e4m3's NaN (the FP8 forward's Vt)


def _readable(kind: str, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Can the kernels read the operand as it is? (A Launch remembers the strides that passed,
    so a repeated call checks only the pointer's alignment.)"""
    if kind == TILE:
        return _interop.kernel_readable(ptr, shape, strides)
    if kind == FP8_TILE:  # bytes: 16-byte chunks are 16 elements
        return ptr % 16 == 0 and _interop.tile_layout_readable(shape, strides, chunk=16)
    if kind == CONTIGUOUS:
        return _is_contiguous(shape, strides)
    return not shape or shape[-1] <= 1 or strides[-1] == 1  # INDEX, LENGTHS: unit stride on the last axis


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """C-contiguous, ignoring the strides of size-1 axes (never used)."""
    step = 1
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n > 1 and stride != step:
            return False
        step *= n
    return True


def run(
    launch: Launch, lib: ArrayLib, device: int, arrays: Mapping[str, Any], want_lse: bool,
    given: Mapping[str, Any] = EMPTY,
) -> tuple[Any, Any]:  # fmt: skip
    """Execute ``launch`` on the caller's stream; returns (out, lse), lse None unless wanted
    (or always allocated by the plan). Results are in the caller's type. ``given``: arrays the
    kernels write instead of fresh ones, by output name (XLA's buffers under ``jax.jit``)."""
    if _interop.current_device() == device:  # device switched only when it is not current
        results = _run(launch, lib, device, arrays, want_lse, given)
    else:
        results = _on_device(launch, lib, device, arrays, want_lse, given)
    return results["out"], results.get("lse")


def run_outputs(
    launch: Launch, lib: ArrayLib, device: int, arrays: Mapping[str, Any], given: Mapping[str, Any] = EMPTY
) -> tuple[Any, ...]:
    """Execute ``launch``; every output in the plan's order (the backward's dq, dk, dv)."""
    if _interop.current_device() == device:
        results = _run(launch, lib, device, arrays, True, given)
    else:
        results = _on_device(launch, lib, device, arrays, True, given)
    return tuple(results[output.name] for output in launch.outputs)


def _on_device(
    launch: Launch, lib: ArrayLib, device: int, arrays: Mapping[str, Any], want_lse: bool, given: Mapping[str, Any]
) -> dict[str, Any]:
    """``_run`` with ``device`` made current for the call."""
    with _interop.cupy_module().cuda.Device(device):
        return _run(launch, lib, device, arrays, want_lse, given)


def _given_output(lib: ArrayLib, output: Any, array: Any) -> Any:
    """A caller's buffer for ``output``: it must be what the plan would allocate (C-contiguous,
    the plan's shape and dtype), since the kernels write it with the plan's strides."""
    shape = tuple(array.shape)
    if shape != output.shape or lib.dtype_name(array) != output.dtype or not _is_contiguous(shape, lib.strides(array)):
        raise ValueError(
            f"the buffer given for {output.name} is {lib.dtype_name(array)} {shape}; the kernels write a "
            f"C-contiguous {output.dtype} {output.shape}"
        )
    if lib.ptr(array) & 15:
        raise ValueError(f"the buffer given for {output.name} is not 16-byte aligned (the kernels store 16 bytes)")
    return array


def _run(
    launch: Launch, lib: ArrayLib, device: int, arrays: Mapping[str, Any], want_lse: bool, given: Mapping[str, Any]
) -> dict[str, Any]:
    # The layouts last found readable (``Launch.layouts``): a call whose arrays have the same raw
    # strides starts from params values that hold their strides, and checks only the pointers.
    raws, known, template, packed = launch.layouts[0]
    values = list(template)
    bound: list[Any] | None = [None] * len(raws) if launch.needs_bound else None  # (ptr, strides)
    keep: list[Any] = []  # copies made for this call: alive until the launches are queued
    ptr_of, raw_strides_of = lib.ptr, lib.raw_strides
    pointers_only = launch.pointer_words is not None  # values differ from the template in pointers alone
    # The common operand (an array, read as it is) takes the loop's straight path, and so does an
    # int length the Launch's template holds (given twice in a row, checked: a shared prefix's
    # length, the same every decode step); another int, a negated q, a pointer offset or a layout
    # the kernels cannot read take _bind.
    for i, name, ptr_slot, align in launch.bindings:
        x = arrays.get(name)
        if x is None:
            if raws[i] is not None:  # an optional operand left out: its strides as planned
                _unbind(launch, i, values)
                pointers_only = False
            continue
        raw = raws[i]
        if raw is not None:
            if type(x) is not int:
                ptr = ptr_of(x)
                if not ptr & align and raw_strides_of(x) == raw:
                    values[ptr_slot] = ptr
                    if bound is not None:
                        bound[i] = (ptr, known[i])
                    continue
            elif raw == x:
                continue
        _bind(launch, i, x, lib, values, bound, keep)
        pointers_only = False

    stream = lib.stream(device)
    poison = POISON_OUTPUTS and bool(launch.steps)
    results: dict[str, Any] = {}
    like = arrays.get(launch.operands[0].name) if launch.operands else None  # (a mask summary may have none)
    for output in launch.outputs:
        if output.optional and not want_lse:
            continue
        mine = given.get(output.name) if given else None
        if mine is None:
            array = lib.empty(output.shape, output.dtype, device, like)
        else:
            array = _given_output(lib, output, mine)
        fill = (POISON_BYTE if output.dtype == "uint8" else math.nan) if poison else output.fill
        if fill is not None:
            lib.fill(array, fill)
        values[output.ptr_slot] = lib.ptr(array)
        results[output.name] = array
    temporaries = EMPTY
    if launch.temporaries:
        temporaries = {t.name: lib.empty(t.shape, t.dtype, device, like) for t in launch.temporaries}
        for t in launch.temporaries:
            if t.ptr_slot >= 0:
                values[t.ptr_slot] = lib.ptr(temporaries[t.name])
    if launch.scratch is not None:
        s = launch.scratch
        counters, scratch = _workspace.stream_scratch(
            lib, device, stream, s.counter_bytes, s.scratch_bytes, poison=poison
        )
        values[s.counter_slot] = counters
        for slot, offset in s.scratch_slots:
            values[slot] = scratch + offset
    if launch.error_slot >= 0 and launch.steps:
        word = _workspace.error_word_ptrs.get(device)
        values[launch.error_slot] = word if word is not None else _workspace.device_error_word(device, stream)

    kernels = launch.kernels or _first_meeting(launch, device)
    fast = (launch.params.struct, packed, launch.pointer_words) if pointers_only else None
    for step, kernel in zip(launch.steps, kernels):
        if kernel is None:  # a step that launches itself (the naive baseline's cuBLAS GEMMs)
            step.execute(lib, device, stream, launch, bound, results, temporaries)
        elif step.buffers:
            buffers = tuple(np.uint64(lib.ptr(temporaries[name])) for name in step.buffers)
            kernel.launch_with_buffers(step.grid, step.block, step.smem, stream, tuple(values), buffers)
        else:
            maps = None if step.tma is None else _tensor_maps(step.tma, launch, bound)
            kernel.launch(step.grid, step.block, step.smem, stream, values, maps, fast)
    del keep
    if lib.wraps:
        return {name: lib.wrap(array) for name, array in results.items()}
    return results


def _bind(
    launch: Launch, i: int, x: Any, lib: ArrayLib, values: list[Any], bound: list[Any] | None, keep: list[Any]
) -> None:
    """Operand ``i``'s fields, the general way: an int length checked, q negated, the layout
    checked (a copy where the kernels cannot read it), a pointer given as an offset."""
    op = launch.operands[i]
    if op.kind is SCALAR:  # checked by the entry point
        values[op.ptr_slot] = x
        return
    if op.kind is LENGTHS and type(x) is int:  # one length for every sequence: check it here
        check_int_seqlens(x, *op.int_limit)
        if op.int_rotary is not None:  # (a plan serves every int: checked here, per call)
            check_rotary_positions(x, *op.int_rotary)
        values[op.int_slot] = x
        if launch.ints_seen[i] == x:  # the same int twice in a row: into the template
            _remember_int(launch, i, x)
        else:
            launch.ints_seen[i] = x
        return
    if op.negate:
        x = -x
        keep.append(x)
    ptr, strides = lib.ptr(x), lib.strides(x)
    if not _readable(op.kind, ptr, x.shape, strides):
        x, ptr, strides = _readable_copy(lib, op, x)
        keep.append(x)
    elif launch.plain[i]:  # the straight path takes this layout from the next call on
        _remember(launch, i, lib.raw_strides(x), strides)
    if op.offset_of is None:
        values[op.ptr_slot] = ptr
    else:
        slot, base, itemsize = op.offset_of
        assert bound is not None  # a Launch with an offset operand keeps the pointers
        distance = ptr - bound[launch.operand_index[base]][0]
        assert distance % itemsize == 0, f"{op.name} is not element-aligned with {base}"
        values[slot] = distance // itemsize
    for slot, axis in op.stride_slots:
        values[slot] = strides[axis]
    if bound is not None:
        bound[i] = (ptr, strides)


def _remember(launch: Launch, i: int, raw: Any, strides: tuple[int, ...]) -> None:
    """Operand ``i``'s readable layout into ``launch.layouts``, as a new item built from the
    current one (a thread that reads the item meanwhile sees the old one or the new one whole)."""
    raws, known, template, _ = launch.layouts[0]
    values = list(template)
    for slot, axis in launch.operands[i].stride_slots:
        values[slot] = strides[axis]
    launch.layouts[0] = (
        raws[:i] + (raw,) + raws[i + 1 :], known[:i] + (strides,) + known[i + 1 :], tuple(values),
        launch.params.struct.pack_bytes(values),
    )  # fmt: skip


def _remember_int(launch: Launch, i: int, x: int) -> None:
    """An int length ``x`` (checked) into ``launch.layouts``: the template holds it and its raw
    entry is the int, so the next call with the same int takes the straight path."""
    raws, known, template, _ = launch.layouts[0]
    values = list(template)
    values[launch.operands[i].int_slot] = x
    launch.layouts[0] = (
        raws[:i] + (x,) + raws[i + 1 :], known, tuple(values), launch.params.struct.pack_bytes(values)
    )  # fmt: skip


def _unbind(launch: Launch, i: int, values: list[Any]) -> None:
    """An absent optional operand's stride slots (and an int length's slot) back to the plan's
    values (0)."""
    planned = launch.params.values
    op = launch.operands[i]
    for slot, _ in op.stride_slots:
        values[slot] = planned[slot]
    if op.int_slot >= 0:
        values[op.int_slot] = planned[op.int_slot]


def _first_meeting(launch: Launch, device: int) -> list[Any]:
    """The compiled kernels of a Launch's steps (None for a step that launches itself), looked
    up (or compiled) when the Launch first runs, then kept on it: a hot call does no lookup."""
    launch.kernels[:] = [_kernels.get_kernel(s.spec, device) if type(s) is KernelStep else None for s in launch.steps]
    return launch.kernels


def _readable_copy(lib: ArrayLib, op: Operand, x: Any) -> tuple[Any, int, tuple[int, ...]]:
    if op.in_place:
        aligned = " and 16-byte aligned strides and base pointer" if op.kind in (TILE, FP8_TILE) else ""
        raise ValueError(
            f"{op.name} must have a unit stride on head_dim{aligned} (it is written in place, so it cannot be copied)"
        )
    x = lib.copy(x)
    return x, lib.ptr(x), lib.strides(x)


def _tensor_maps(tma: TmaMaps, launch: Launch, bound: list[Any] | None) -> bytes:
    """The step's maps over (d, rows, heads, batch), from this call's pointers and strides
    (``_tma`` keeps the last ones: loops call again on the same buffers)."""
    assert bound is not None  # a Launch with TMA maps keeps the pointers
    row, head, batch = tma.axes
    maps = b""
    for name, dims, box in tma.maps:
        ptr, strides = bound[launch.operand_index[name]]
        axis_strides = (strides[row], strides[head], strides[batch] if batch >= 0 else 0)
        maps += _tma.tile_map(tma.dtype, ptr, dims, axis_strides, box)
    return maps
