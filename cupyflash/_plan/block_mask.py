"""A BlockMask's plans (``cupyflash.create_block_mask``): the summary kernel that evaluates a
mask_mod over every cell once, and the layout (``BlockCells``) by which the attention kernels of
each call read the summary and its shown ranges."""

from __future__ import annotations

from dataclasses import dataclass

from .._mods import KernelMods
from .._params import PARAMS_STRUCTS, ParamsTemplate
from .._specs import BlockMaskCellsSpec
from .common import check_grid, contiguous_strides, mods_operands
from .model import SCALAR, KernelStep, Launch, Operand, Output

#: Rows (keys) per entry of the shown ranges (kernels_cu/variants.cuh's kMaskRangeBlock).
RANGE_BLOCK = 128


def _broadcast_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides, 0 on an axis of one (a broadcast batch or head)."""
    return tuple(0 if n == 1 else s for n, s in zip(shape, contiguous_strides(shape), strict=True))


@dataclass(frozen=True, slots=True)
class BlockCells:
    """A BlockMask's summary as the attention kernels read it: the params fields of its layout
    (cell sizes, the strides of its cells and ranges, 0 on a broadcast axis), fixed in a plan.
    The three buffers' addresses are per-call operands (``operands``). Hashable: part of a
    plan's key."""

    fields: tuple[tuple[str, int], ...]

    @staticmethod
    def of(shape: tuple[int, int, int, int], block: tuple[int, int]) -> BlockCells:
        """The layout of a C-contiguous summary ``shape`` (B|1, H|1, cell rows, key cells) of
        ``block`` (rows, keys) cells, its ranges per RANGE_BLOCK rows and keys (int32 pairs)."""
        batches, heads, cells_m, cells_n = shape
        cells = _broadcast_strides(shape)
        key_ranges = _broadcast_strides((batches, heads, cells_m * block[0] // RANGE_BLOCK, 2))
        row_ranges = _broadcast_strides((batches, heads, cells_n * block[1] // RANGE_BLOCK, 2))
        fields = {
            "mask_cells_batch_stride": cells[0], "mask_cells_head_stride": cells[1],
            "mask_cells_row_stride": cells_n, "mask_cells_key_stride": 1,
            "mask_cell_rows_log2": block[0].bit_length() - 1, "mask_cell_keys_log2": block[1].bit_length() - 1,
            "mask_key_ranges_batch_stride": key_ranges[0], "mask_key_ranges_head_stride": key_ranges[1],
            "mask_row_ranges_batch_stride": row_ranges[0], "mask_row_ranges_head_stride": row_ranges[1],
        }  # fmt: skip
        return BlockCells(tuple(fields.items()))

    @staticmethod
    def operands(params: ParamsTemplate) -> list[Operand]:
        """The summary's buffers, by address (ints: a BlockMask's arrays may be of another
        library than the call's, on its device)."""
        return [
            Operand(name, SCALAR, params.slot(name)) for name in ("mask_cells", "mask_key_ranges", "mask_row_ranges")
        ]


def plan_block_mask_cells(
    kernel: KernelMods, extents: tuple[int, int], lengths: tuple[int, int], block: tuple[int, int],
    cells: tuple[int, int],
) -> Launch:  # fmt: skip
    """The summary kernel (kernels_cu/attn_mask.cuh's block_mask_cells) of a mask_mod (``kernel``:
    ``_mods.kernel_mods(None, mask_mod)``, its captured arrays operands mod_buffer0, 1, ...) over
    ``lengths`` (Nq, Nk) for batch entries and heads ``extents`` (1 on an axis the mask does not
    read), cells of ``block`` rows x keys: output "cells" (extents, cells), uint8 states."""
    check_grid(*extents)
    if cells[0] > 65535 or extents[0] * extents[1] > 65535:
        raise ValueError(
            f"a summary of {cells[0]} cell rows over {extents[0]} x {extents[1]} (batch, heads) is beyond the grid: "
            "use a larger BLOCK_SIZE, or B / H = None where the mask is the same for all"
        )
    shape = (*extents, *cells)
    strides = _broadcast_strides(shape)
    params = PARAMS_STRUCTS["AttnParams"].template(
        seqlen_q=lengths[0], seqlen_k=lengths[1], mask_cells_batch_stride=strides[0],
        mask_cells_head_stride=strides[1], mask_cells_row_stride=cells[1], mask_cells_key_stride=1,
        mask_cell_rows_log2=block[0].bit_length() - 1, mask_cell_keys_log2=block[1].bit_length() - 1,
        mask_heads=extents[1], mod_score_scale=1.0,
    )  # fmt: skip
    spec = BlockMaskCellsSpec(kernel.source)
    step = KernelStep(spec, (cells[1], cells[0], extents[0] * extents[1]), (spec.num_threads, 1, 1), 0)
    outputs = (Output("cells", shape, "uint8", params.slot("mask_cells")),)
    return Launch(params, tuple(mods_operands(params, kernel)), outputs, (step,))
