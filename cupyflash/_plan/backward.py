"""The backward's planner: prep (D = rowsum(dO * O)), the key-block kernel (FA2's mma.sync or
the Hopper kernel), the dQ conversion, and the deterministic mode's extra steps."""

from __future__ import annotations

import math
from dataclasses import replace

from .. import _dispatch
from .._device import DeviceInfo
from .._mods import KernelMods
from .._params import PARAMS_STRUCTS
from .._specs import (
    HOPPER_ARCH,
    BwdRowSpec,
)
from .._validate import Problem
from .block_mask import BlockCells
from .common import (
    LAYOUT_AXES,
    STRIDE_NAMES,
    attn_fields,
    check_grid,
    check_head_dim,
    contiguous_strides,
    error_word_slot,
    fa2_option_operands,
    filled_output,
    mask_cells,
    mask_flags,
    mods_operands,
    mods_scale_fields,
    packed_fill_step,
    packed_max_fields,
    softmax_factors,
    tile_kind,
    tile_operand,
)
from .model import INDEX, KernelStep, Launch, Operand, Output, Temporary, TmaMaps

DQ_TILE_ROWS = 64  # the Hopper backward's dQacc tiles (kDqTileRows, kernels_cu/dq_tiles.cuh)
# Packed sequences in those tiles: each sequence's temporary rows from a multiple of this (kDqSeqAlign)
DQ_SEQ_ALIGN = 128
# BwdParams::dq_tiled (0: rows of d floats); swapped: the 80-row steps' (kDqTilesSwapped)
DQ_TILES_PADDED, DQ_TILES_PACKED, DQ_TILES_SWAPPED = 1, 2, 3


def plan_backward(
    p: Problem,
    dtype: str,
    device: DeviceInfo,
    *,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    packed_rows: tuple[int, int] | None = None,
    deterministic: bool = False,
    mods: KernelMods | None = None,
    cells: BlockCells | None = None,
) -> Launch:
    """The backward: the per-row preparation, the main kernel over key blocks, dQ from its fp32
    accumulator (kernels_cu/fa2_bwd.cu; on Hopper the main kernel is kernels_cu/fa3_bwd.cu's
    where it has the variant: ``_dispatch.fa3_bwd_spec``). Operands q, k, v, out, dout, lse, the
    optional dlse (and cu_seqlens when ``packed_rows``); outputs dq, dk, dv as fresh arrays of
    q's and k's shape.

    The kernels differentiate with respect to the raw score q . k (see fa2_bwd.cu): dQ carries
    ``scale``; dK carries |scale| where q runs negated (a negative scale without softcap), else
    ``scale``. ``deterministic``: bit-identical from run to run. On Hopper, the key blocks add
    into each dQ tile in a fixed order (a semaphore per tile); elsewhere dQ comes from its own
    kernel over query blocks instead of fp32 atomics (two of the five products computed twice).
    ``mods``: the forward's score_mod / mask_mod, compiled into the kernels (dS times the score
    function's derivative): the Hopper backward where it has the head dim, else the mma.sync
    ones; its captured arrays operands mod_buffer0, 1, ...; ``cells``: its BlockMask's summary, as
    ``plan_forward``'s."""
    check_grid(p.batch, p.heads_q)
    check_head_dim(p.head_dim, "the GPU backward kernels")
    packed = packed_rows is not None
    scale_log2, prescale, negate_q = softmax_factors(p)
    axes = LAYOUT_AXES["thd" if packed else p.layout]
    rows = packed_rows if packed_rows is not None else (p.seqlen_q, p.seqlen_k)
    has_work = p.batch > 0 and p.heads_q > 0 and rows[0] > 0 and rows[1] > 0
    flags = mask_flags(p)
    source = ""
    if mods is not None:
        if flags.softcap or flags.dropout or flags.alibi or p.mask:
            raise ValueError("on the GPU, score_mod / mask_mod do not combine with softcap, dropout or ALiBi yet")
        flags, source = replace(flags, mask="mods"), mods.source
    hopper = None
    if device.arch == HOPPER_ARCH and not p.seqused_k:
        # the functions' hook in the Hopper backward (kernels_cu/fa3_bwd.cu): its query blocks
        # bounded by a summary's row ranges where there is one; a mask_mod alone on mixed tiles
        # alone, a score_mod (and its derivative) where dS^T is formed, from the raw scores
        mods_source = mods.source if mods is not None else ""
        hopper = _dispatch.fa3_bwd_spec(dtype, p.head_dim, flags, deterministic, packed, mods_source)
        if hopper is not None and hopper.smem_bytes > device.max_smem_per_block:
            hopper = None
    spec = _dispatch.fa2_bwd_spec(dtype, p.head_dim, flags, deterministic, source)
    if hopper is None and spec.smem_bytes > device.max_smem_per_block:
        raise ValueError(
            f"the GPU backward at head_dim={p.head_dim} needs {spec.smem_bytes} bytes of shared memory per block; "
            f"this GPU has {device.max_smem_per_block}"
        )

    # Per-row temporaries: row r of query head h, batch b at b * row_batch + h * row_head + r.
    # The Hopper kernel's: each (b, h)'s rows padded to whole steps (block_m: one or two 64-row
    # dQacc tiles, or one 80-row swapped tile; the steps' -LSE log2 e and D rows read whole);
    # packed, each sequence's from its own aligned start (dq_seq_temp_start,
    # kernels_cu/dq_tiles.cuh), so that a head's rows end by (ceil(total / align) + batch) align.
    padded_q = -(-p.seqlen_q // hopper.block_m) * hopper.block_m if hopper is not None else p.seqlen_q
    if packed and hopper is not None:
        head_rows = (-(-rows[0] // DQ_SEQ_ALIGN) + p.batch) * DQ_SEQ_ALIGN
        row_strides, temp_rows, batches = (0, head_rows), p.heads_q * head_rows, 1
    elif packed:
        row_strides, temp_rows, batches = (0, rows[0]), p.heads_q * rows[0], 1
    else:
        row_strides, temp_rows, batches = (
            (p.heads_q * padded_q, padded_q),
            p.batch * p.heads_q * padded_q,
            p.batch,
        )
    q_strides, k_strides = contiguous_strides(q_shape), contiguous_strides(k_shape)
    output_strides = {}
    for name, strides in (("dq", q_strides), ("dk", k_strides), ("dv", k_strides)):
        for s, a in zip(STRIDE_NAMES, axes, strict=True):
            output_strides[f"{name}_{s}_stride"] = strides[a] if a >= 0 else 0
    dq_kernel = deterministic and hopper is None  # dQ over query blocks, no accumulator
    cell_tiles = [(spec.block_m, spec.block_n)]
    if dq_kernel:
        dq_spec = _dispatch.fa2_bwd_dq_spec(dtype, p.head_dim, flags, source)
        cell_tiles.append((dq_spec.block_m, dq_spec.block_n))
    cell_fields: dict[str, int] = {}
    if p.mask:  # its block summary, for both kernels' tiles: they skip the tiles it hides
        cell_fields, cells_shape, cells_step = mask_cells(p, dtype, cell_tiles, "BwdParams")
    # The key blocks: the Hopper kernel's over packed sequences cover the longest sequence (a CTA
    # per key block and sequence: over the packed total most would return at once), and prep
    # reports a sequence longer than that (grid_keys); the others' cover the packed total.
    key_rows = p.seqlen_k if packed and hopper is not None else rows[1]
    key_blocks = max(1, -(-key_rows // (hopper or spec).block_n))
    dq_tiled = (
        0 if hopper is None
        else DQ_TILES_PACKED if packed
        else DQ_TILES_SWAPPED if hopper.rows80
        else DQ_TILES_PADDED
    )  # fmt: skip
    lpt_pairs = 0  # the causal Hopper kernel's CTA order: sections of (batch, KV head) pairs
    if hopper is not None:
        rows_per_pair = rows[0] // max(p.batch, 1) if packed else rows[0]
        group = p.heads_q // max(p.heads_kv, 1)
        lpt_pairs = _dispatch.fa3_bwd_lpt_pairs(hopper, rows_per_pair, group, p.batch * p.heads_kv)
    params = PARAMS_STRUCTS["BwdParams"].template(
        **attn_fields(p, rows, scale_log2, prescale)
        | (mods_scale_fields(mods, scale_log2) if mods is not None else {}),  # (as the forward's)
        **cell_fields,
        **(dict(cells.fields) if cells is not None else {}),
        **output_strides,
        row_batch_stride=row_strides[0],
        row_head_stride=row_strides[1],
        dq_scale=p.scale,
        dk_scale=abs(p.scale) if negate_q else p.scale,
        dq_tiled=dq_tiled,
        grid_keys=key_blocks * hopper.block_n if packed and hopper is not None else 0,
        lpt_pairs=lpt_pairs,
        **(packed_max_fields(p) if packed else {}),
    )

    def lse_axes(name: str) -> tuple[tuple[int, int], ...]:  # (Hq, total_q) packed, else (B, Hq, Nq)
        if packed:
            return ((params.slot(f"{name}_head_stride"), 0),)
        return ((params.slot(f"{name}_batch_stride"), 0), (params.slot(f"{name}_head_stride"), 1))

    kind = tile_kind(p.head_dim)
    operands = [
        tile_operand(params, "q", axes, negate=negate_q, kind=kind),
        tile_operand(params, "k", axes, kind=kind),
        tile_operand(params, "v", axes, kind=kind),
        tile_operand(params, "out", axes, field_prefix="o", kind=kind),
        tile_operand(params, "dout", axes, field_prefix="do", kind=kind),
        Operand("lse", INDEX, params.slot("lse_ptr"), lse_axes("lse")),
        Operand("dlse", INDEX, params.slot("dlse_ptr"), lse_axes("dlse")),  # optional
    ]
    operands += fa2_option_operands(params, p)
    if mods is not None:
        operands += mods_operands(params, mods)
    if cells is not None:
        assert mods is not None, "a BlockMask's summary comes with its mask_mod"
        operands += BlockCells.operands(params)
    if packed:
        operands += [
            Operand("cu_seqlens_q", INDEX, params.slot("cu_seqlens_q")),
            Operand("cu_seqlens_k", INDEX, params.slot("cu_seqlens_k")),
        ]
    # Packed rows outside every sequence get no gradient: 0, written by the launch's first step
    # (packed_fill.cu: the rows no sequence owns). With seqused_k the keys past a sequence's used
    # ones are in no kernel's range either: a fill of the whole of dk and dv, and of dq where its
    # rows are not all written from the zeroed accumulator (by dq_blocks, or from the Hopper
    # kernel's sequence-aligned tiles).
    fill_step = packed and not p.seqused_k
    fill = 0.0 if packed and not fill_step else None
    dq_fill = fill if dq_kernel or dq_tiled == DQ_TILES_PACKED else None
    outputs: tuple[Output, ...] = (
        Output("dq", tuple(q_shape), dtype, params.slot("dq_ptr"), fill=dq_fill),
        Output("dk", tuple(k_shape), dtype, params.slot("dk_ptr"), fill=fill),
        Output("dv", tuple(k_shape), dtype, params.slot("dv_ptr"), fill=fill),
    )
    if p.sinks:  # each row's share of dsinks (prep), zero on the padding rows; summed per head by the caller
        outputs += (Output("dsink_rows", (batches, p.heads_q, temp_rows // (batches * p.heads_q or 1)), "float32",
                           params.slot("dsink_rows"), fill=0.0),)  # fmt: skip
    if not has_work:  # no query or no key: every gradient is 0
        return Launch(params, tuple(operands), tuple(filled_output(o) for o in outputs))
    temporaries: tuple[Temporary, ...] = (
        Temporary("neg_lse_log2", (temp_rows,), "float32", params.slot("neg_lse_log2")),
        Temporary("dsum", (temp_rows,), "float32", params.slot("dsum")),
    )
    # the per-row kernels' rows: the input's (packed: the totals, not max_seqlen_q), or the
    # sequence-aligned temporaries'
    row_count = row_strides[1] if dq_tiled == DQ_TILES_PACKED else rows[0] if packed else padded_q
    row_block = (BwdRowSpec.num_threads, 1, 1)
    # Packed: the grids over query blocks cover the totals, not max_seqlen_q: every sequence fits
    # in its total, so an understated maximum cannot leave rows without dQ (the CTAs past a
    # sequence's end return at once); the key blocks are above.
    grid = (key_blocks, p.batch, p.heads_kv)
    if hopper is not None:
        q_dims, kv_dims = (p.head_dim, rows[0], p.heads_q, batches), (p.head_dim, rows[1], p.heads_kv, batches)
        maps = (("q", q_dims, hopper.block_m), ("k", kv_dims, hopper.block_n), ("v", kv_dims, hopper.block_n),
                ("dout", q_dims, hopper.block_m))  # fmt: skip
        tma = TmaMaps(dtype, (axes[1], axes[2], axes[0]), maps)
        main = KernelStep(hopper, grid, (hopper.num_threads, 1, 1), hopper.smem_bytes, tma=tma)
    else:
        main = KernelStep(spec, grid, (spec.num_threads, 1, 1), spec.smem_bytes)
    if dq_kernel:
        dq_grid = (-(-rows[0] // dq_spec.block_m), p.batch, p.heads_q)
        dq_step = KernelStep(dq_spec, dq_grid, (dq_spec.num_threads, 1, 1), dq_spec.smem_bytes)
    else:  # the accumulator the main kernel adds into, zeroed by prep, converted by the dq step
        convert = _dispatch.bwd_row_spec("dq", dtype, p.head_dim)  # rows of the tile's width
        # (dq reads the 80-row tiles on its full d = 128 variant only: fa2_bwd.cu's dq_swapped path)
        assert dq_tiled != DQ_TILES_SWAPPED or (convert.head_dim, convert.valid_dim) == (128, 0), convert
        temporaries += (Temporary("dq_accum", (temp_rows, convert.head_dim), "float32", params.slot("dq_accum")),)
        dq_step = KernelStep(convert, (convert.grid_x(row_count), batches, p.heads_q), row_block, 0)
        if hopper is not None and deterministic:  # its add count per 64-row tile, zeroed by prep
            tiles = temp_rows // DQ_TILE_ROWS  # (a 128-row step uses its first tile's)
            temporaries += (Temporary("dq_semaphore", (tiles,), "int32", params.slot("dq_semaphore")),)
    prep = _dispatch.bwd_row_spec("prep", dtype, p.head_dim)
    prep_step = KernelStep(prep, (prep.grid_x(row_count), batches, p.heads_q), row_block, 0)
    steps: tuple[KernelStep, ...] = (prep_step, main, dq_step)
    if fill_step:
        steps = (packed_fill_step("BwdParams", max(rows), max(p.heads_q, p.heads_kv) * p.head_dim), *steps)
    if p.mask:
        steps = (cells_step, *steps)
        temporaries += (Temporary("mask_cells", (math.prod(cells_shape),), "uint8", params.slot("mask_cells")),)
    error_slot = error_word_slot(params) if packed else -1  # the main kernel checks cu_seqlens, seqused_k
    return Launch(params, tuple(operands), outputs, steps, temporaries=temporaries, error_slot=error_slot)
