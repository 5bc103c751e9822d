"""``merge_states``' planner, and the merge of a cascade call's parts."""

from __future__ import annotations

from dataclasses import dataclass

from .._params import PARAMS_STRUCTS
from .._specs import (
    CUDA_ELEMENT_TYPES,
    MergeSpec,
)
from .common import check_gpu_dtypes
from .model import CONTIGUOUS, KernelStep, Launch, Operand, Output


def plan_merge(dims: tuple[int, int, int, int], dtypes: dict[str, str]) -> Launch:
    """merge_states: one warp per output row, part b read at a fixed offset from part a."""
    b, n, h, d = dims
    dtype = check_gpu_dtypes({"o_a": dtypes["o_a"], "o_b": dtypes["o_b"]}, {**CUDA_ELEMENT_TYPES, "float32": "float"})
    for name in ("lse_a", "lse_b"):
        if dtypes[name] != "float32":
            raise TypeError(f"{name} must be float32, got {dtypes[name]}")
    if not (d and d % 32 == 0 and d <= 256):
        raise ValueError(f"merge_states on the GPU takes head_dim a multiple of 32 up to 256, got {d}")
    spec = MergeSpec(dtype, dtype, d)
    itemsize = 4 if dtype == "float32" else 2
    params = PARAMS_STRUCTS["MergeParams"].template(
        o_batch_stride=n * h * d, o_row_stride=h * d, o_head_stride=d, lse_batch_stride=h * n, lse_head_stride=n,
        out_batch_stride=n * h * d, out_row_stride=h * d, out_head_stride=d,
        out_lse_batch_stride=h * n, out_lse_head_stride=n, num_parts=2, batch=b, seqlen_q=n, heads=h,
    )  # fmt: skip
    # Both parts must share one layout: the kernel reads part 1 at a fixed distance from part 0.
    operands = (
        Operand("o_a", CONTIGUOUS, params.slot("o_parts_ptr")),
        Operand("lse_a", CONTIGUOUS, params.slot("lse_parts_ptr")),
        Operand("o_b", CONTIGUOUS, offset_of=(params.slot("o_part_stride"), "o_a", itemsize)),
        Operand("lse_b", CONTIGUOUS, offset_of=(params.slot("lse_part_stride"), "lse_a", 4)),
    )
    outputs = (
        Output("out", (b, n, h, d), dtype, params.slot("o_ptr")),
        Output("lse", (b, h, n), "float32", params.slot("lse_ptr")),
    )
    rows = b * n * h
    steps: tuple[KernelStep, ...] = ()
    if rows:
        steps = (KernelStep(spec, (-(-rows // MergeSpec.rows_per_block), 1, 1), (MergeSpec.num_threads, 1, 1), 0),)
    return Launch(params, operands, outputs, steps)


@dataclass(frozen=True, slots=True)
class PartsLayout:
    """Where ``plan_merge_parts`` finds part p of row (b, i, h) of S partial states held in one
    C-contiguous array each, and where it writes the merged row: element strides over the
    kernel's index space (batch b, row i, head h; the LSE's row stride is 1)."""

    dims: tuple[int, int, int, int]  # (batch, rows, heads, d) of the index space
    num_parts: int
    o_strides: tuple[int, int, int, int]  # part, batch, row, head
    lse_strides: tuple[int, int, int]  # part, batch, head
    out_shape: tuple[int, ...]
    out_strides: tuple[int, int, int]  # batch, row, head
    lse_shape: tuple[int, ...]
    out_lse_strides: tuple[int, int]  # batch, head


def plan_merge_parts(layout: PartsLayout, dtype: str) -> Launch:
    """S partial states merged by their LSE in one launch (the split-KV merge kernel), read and
    written through ``layout``: a shared-prefix call's key ranges, in the layout of the varlen
    kernel's packed output."""
    b, n, h, d = layout.dims
    dtype = check_gpu_dtypes({"o_parts": dtype}, dict(CUDA_ELEMENT_TYPES))
    if not (d and d % 32 == 0 and d <= 256):
        raise ValueError(f"the merge on the GPU takes head_dim a multiple of 32 up to 256, got {d}")
    o, lse, out, out_lse = layout.o_strides, layout.lse_strides, layout.out_strides, layout.out_lse_strides
    params = PARAMS_STRUCTS["MergeParams"].template(
        o_part_stride=o[0], o_batch_stride=o[1], o_row_stride=o[2], o_head_stride=o[3], lse_part_stride=lse[0],
        lse_batch_stride=lse[1], lse_head_stride=lse[2], out_batch_stride=out[0], out_row_stride=out[1],
        out_head_stride=out[2], out_lse_batch_stride=out_lse[0], out_lse_head_stride=out_lse[1],
        num_parts=layout.num_parts, batch=b, seqlen_q=n, heads=h,
    )  # fmt: skip
    operands = (
        Operand("o_parts", CONTIGUOUS, params.slot("o_parts_ptr")),
        Operand("lse_parts", CONTIGUOUS, params.slot("lse_parts_ptr")),
    )
    outputs = (
        Output("out", layout.out_shape, dtype, params.slot("o_ptr")),
        Output("lse", layout.lse_shape, "float32", params.slot("lse_ptr")),
    )
    rows = b * n * h
    steps: tuple[KernelStep, ...] = ()
    if rows:
        steps = (KernelStep(MergeSpec(dtype, dtype, d), (-(-rows // MergeSpec.rows_per_block), 1, 1),
                            (MergeSpec.num_threads, 1, 1), 0),)  # fmt: skip
    return Launch(params, operands, outputs, steps)
