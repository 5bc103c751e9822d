"""Building blocks the planners share: the softmax's float32 factors, operands of the tiled
tensors, dtype and size checks, the params fields every attention kernel has, and the variant
flags of a problem."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .. import _dispatch
from .._mods import KernelMods
from .._params import ParamsTemplate
from .._specs import (
    CUDA_ELEMENT_TYPES,
    MAX_HEAD_DIM,
    MaskCellsSpec,
    PackedFillSpec,
)
from .._validate import ALIBI_BATCH_HEAD, ALIBI_NONE, Problem
from ..xp_impl import Dropout
from .model import INDEX, ROWS, SCALAR, TILE, KernelStep, Operand, Output

# ---------------------------------------------------------------------------------------------
# The softmax's float32 factors.
# ---------------------------------------------------------------------------------------------
# The smallest softmax multiplier the kernels run with (scale 0, tiny scales or softcaps):
# exp2(x * 1e-30 - m * 1e-30) rounds to exactly 1 in float32 for any 16-bit score, so the result
# is the uniform average, as the limit requires; 0 itself would turn masked -inf * 0 into NaN.
ZERO_SCALE_SURROGATE = 1e-30
ALIBI_ZERO_SCALE_SURROGATE = 1e-20
# The kernels scale float32 scores: |scale| <= 1e6 keeps |q.k| * scale * log2(e) finite for every
# float16 input (|q.k| <= 65504^2 * 256 ~ 1.1e12), where a larger one could overflow silently.
MAX_GPU_SCALE = 1e6
# tanh(s * prescale) saturates long before float32 runs out; clamping keeps the pack in range.
MAX_SOFTCAP_PRESCALE = 1e30
LOG2E = 1.0 / math.log(2.0)


def softmax_factors(problem: Problem) -> tuple[float, float, bool]:
    """(softmax_scale_log2, softcap_prescale, negate_q) for AttnParams.

    The kernel keeps its running max on raw scores, which needs a positive float32 multiplier:
    a negative scale runs as |scale| on -q, and a multiplier under 1e-30 (scale 0, or a tiny
    one) runs as 1e-30, which gives the same softmax in float32. With softcap the multiplier is
    the cap (and the sign of the scale lives in the prescale inside tanh).
    """
    if problem.softcap > 0:
        prescale = max(-MAX_SOFTCAP_PRESCALE, min(MAX_SOFTCAP_PRESCALE, problem.scale / problem.softcap))
        multiplier = min(max(problem.softcap, ZERO_SCALE_SURROGATE), MAX_SOFTCAP_PRESCALE)
        return multiplier * LOG2E, prescale, False
    if abs(problem.scale) > MAX_GPU_SCALE:
        raise ValueError(f"the GPU kernels take |scale| <= {MAX_GPU_SCALE:g} (float32 scores), got {problem.scale}")
    # ALiBi's bias enters the logit divided by the multiplier: 1e-20 keeps slope / multiplier x
    # distance finite for any slope < 1e9 (and 1e-20 x q.k is still nothing beside the bias).
    floor = ALIBI_ZERO_SCALE_SURROGATE if problem.alibi != ALIBI_NONE else ZERO_SCALE_SURROGATE
    return max(abs(problem.scale), floor) * LOG2E, 0.0, problem.scale < 0


# ---------------------------------------------------------------------------------------------
# Building blocks shared by the planners.
# ---------------------------------------------------------------------------------------------
STRIDE_NAMES = ("batch", "row", "head")


def tile_operand(
    params: ParamsTemplate,
    name: str,
    axes: tuple[int, int, int],
    *,
    field_prefix: str | None = None,
    kind: str = TILE,
    **kw: Any,
) -> Operand:
    """A 4-D (or packed 3-D) tensor: ``{prefix}_ptr`` and ``{prefix}_{batch,row,head}_stride``
    from the array axes ``axes`` (-1: no such axis, the stride stays 0)."""
    prefix = field_prefix or name
    ptr_field = f"{prefix}_ptr"
    strides = tuple(
        (params.slot(f"{prefix}_{s}_stride"), axis) for s, axis in zip(STRIDE_NAMES, axes, strict=True) if axis >= 0
    )
    return Operand(name, kind, params.slot(ptr_field), strides, **kw)


def tile_kind(head_dim: int) -> str:
    """How the kernels read a tensor of ``head_dim`` columns: in 16-byte chunks (TILE) where a
    row is a multiple of 8 elements, element by element (ROWS) otherwise."""
    return ROWS if head_dim % 8 else TILE


def check_head_dim(head_dim: int, kernels: str) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{kernels} take head_dim from 1 to {MAX_HEAD_DIM}, got {head_dim}")


def check_gpu_dtypes(names: dict[str, str], allowed: dict[str, str] = CUDA_ELEMENT_TYPES) -> str:
    """The one element type of the named tensors, which the kernels must take."""
    first, dtype = next(iter(names.items()))
    for name, other in names.items():
        if other != dtype:
            listed = ", ".join(f"{n}={d}" for n, d in names.items())
            raise TypeError(f"{name} must have {first}'s dtype {dtype}, got {other} ({listed})")
    if dtype not in allowed:
        raise TypeError(f"the GPU kernels take {sorted(allowed)}, got {dtype}")
    return dtype


def check_int32(names: dict[str, str | None]) -> None:
    for name, dtype in names.items():
        if dtype is not None and dtype != "int32":
            raise TypeError(f"{name} must be int32 (as flash-attn's), got {dtype}")


def check_grid(batch: int, heads: int) -> None:
    if batch > 65535 or heads > 65535:
        raise ValueError(f"batch ({batch}) and heads ({heads}) must be <= 65535 on the GPU")


def attn_fields(p: Problem, rows: tuple[int, int], scale_log2: float, prescale: float) -> dict[str, int | float]:
    """AttnParams' shape and softmax fields (``rows``: seqlen_q, seqlen_k as the kernel reads them)."""
    return {
        "batch": p.batch,
        "seqlen_q": rows[0],
        "seqlen_k": rows[1],
        "h": p.heads_q,
        "h_k": p.heads_kv,
        "h_h_k_ratio": p.heads_q // p.heads_kv if p.heads_kv else 0,
        "window_left": p.window_left,
        "window_right": p.window_right,
        "softmax_scale_log2": scale_log2,
        "softcap_prescale": prescale,
        **dropout_fields(p),
        **({} if p.alibi == ALIBI_NONE and not p.mask else {"alibi_scale": LOG2E / scale_log2}),
    }


def dropout_fields(p: Problem) -> dict[str, int | float]:
    """AttnParams' dropout fields (the seed is per call: a SCALAR operand, ``fa2_option_operands``)."""
    if p.dropout_p == 0:
        return {}
    dropout = Dropout(p.dropout_p, seed=0)  # the host twin's threshold and scale, exactly
    return {"dropout_threshold": dropout.threshold, "dropout_scale": dropout.scale}


def fa2_option_operands(params: ParamsTemplate, p: Problem) -> list[Operand]:
    """The per-call operands of the flash kernels' options: the dropout seed (an int the entry point
    draws or is given), the fp32 ALiBi slopes (Hq,) (batch stride 0) or (B, Hq), the fp32 sinks
    (Hq,), seqused_k, an attn_mask."""
    operands = []
    if p.dropout_p > 0:
        operands.append(Operand("dropout_seed", SCALAR, params.slot("dropout_seed")))
    if p.alibi != ALIBI_NONE:
        strides = ((params.slot("alibi_batch_stride"), 0),) if p.alibi == ALIBI_BATCH_HEAD else ()
        operands.append(Operand("alibi_slopes", INDEX, params.slot("alibi_slopes"), strides))
    if p.sinks:  # fp32 (Hq,): read where a row's final O and LSE are made (softmax.cuh's add_sink)
        operands.append(Operand("sinks", INDEX, params.slot("sinks")))
    if p.seqused_k:
        operands.append(Operand("seqused_k", INDEX, params.slot("seqused_k")))
    if p.mask:  # (B|1, Hq|1, Nq|1, Nk|1): a broadcast axis keeps stride 0
        axes = enumerate(("batch", "head", "row", "key"))
        mask_strides = tuple((params.slot(f"bias_{n}_stride"), a) for a, n in axes if p.mask_shape[a] > 1)
        operands.append(Operand("attn_mask", INDEX, params.slot("bias_ptr"), mask_strides))
    return operands


def mods_scale_fields(mods: KernelMods, scale_log2: float) -> dict[str, float]:
    """The softmax's factors with a score_mod / mask_mod: a score_mod sees the scaled score
    (``mod_score_scale``, the caller's scale) and returns the logit itself, so the softmax
    multiplies by log2 e alone; a mask_mod alone changes no score, so the kernels keep their own
    factor (and a BlockMask's plain tiles run no code: kernels_cu/variants.cuh's UserMods)."""
    if not mods.has_score_mod:
        return {"mod_score_scale": 1.0}
    return {"mod_score_scale": scale_log2 / LOG2E, "softmax_scale_log2": LOG2E}


def mods_operands(params: ParamsTemplate, mods: KernelMods) -> list[Operand]:
    """The captured arrays of a score_mod / mask_mod, in mod_buffer order: element strides into
    the buffer's stride fields (a copy where the last axis is not contiguous)."""
    return [
        Operand(
            f"mod_buffer{i}",
            INDEX,
            params.slot(f"mod_buffer{i}"),
            tuple((params.slot(f"mod_buffer{i}_stride{axis}"), axis) for axis in range(ndim)),
        )  # fmt: skip
        for i, ndim in enumerate(mods.ndims)
    ]


def mask_cells(
    p: Problem, dtype: str, tiles: Sequence[tuple[int, int]], params_type: str
) -> tuple[dict[str, int], tuple[int, ...], KernelStep]:
    """An attn_mask's block summary (kernels_cu/attn_mask.cuh) for kernels of ``tiles`` (block_m,
    block_n): cells of the smallest tile (every tile a whole number of cells), covering the mask's
    rows and keys rounded up to the largest tile (the cells past them read "empty"), one axis of
    one cell where the mask broadcasts. Returns the params fields, the summary's shape and the
    step that writes it, which runs first."""
    batches, heads, rows, keys = p.mask_shape
    cell_rows, cell_keys = min(m for m, _ in tiles), min(n for _, n in tiles)
    tile_rows, tile_keys = max(m for m, _ in tiles), max(n for _, n in tiles)
    assert all(m % cell_rows == 0 and n % cell_keys == 0 for m, n in tiles), tiles
    assert cell_rows & (cell_rows - 1) == 0 and cell_keys & (cell_keys - 1) == 0, tiles  # the kernels shift
    cells_m = -(-p.seqlen_q // tile_rows) * (tile_rows // cell_rows) if rows > 1 else 1
    cells_n = -(-p.seqlen_k // tile_keys) * (tile_keys // cell_keys) if keys > 1 else 1
    shape = (batches, heads, cells_m, cells_n)
    strides = contiguous_strides(shape)
    fields = {
        **{
            f"mask_cells_{n}_stride": st if dim > 1 else 0
            for n, st, dim in zip(("batch", "head", "row", "key"), strides, p.mask_shape, strict=True)
        },
        "mask_cell_rows_log2": cell_rows.bit_length() - 1,
        "mask_cell_keys_log2": cell_keys.bit_length() - 1,
        "mask_heads": heads,
    }
    step = KernelStep(
        MaskCellsSpec("bool" if p.mask == "bool" else dtype, params_type),
        (cells_n, cells_m, batches * heads),
        (MaskCellsSpec.num_threads, 1, 1),
        0,
    )
    return fields, shape, step


def packed_max_fields(p: Problem) -> dict[str, int]:
    """AttnParams' stated longest sequences of a packed call (the grids cover that many rows of a
    sequence; packed_fill.cu fills every row where one is longer)."""
    return {"max_seqlen_q": p.seqlen_q, "max_seqlen_k": p.seqlen_k}


def packed_fill_step(params_type: str, rows: int, row_elements: int) -> KernelStep:
    """A packed launch's first step (kernels_cu/packed_fill.cu): its outputs' rows that no
    sequence owns, 0 (LSE -inf); its grid sized for ``rows`` rows of ``row_elements`` 16-bit
    elements, all of which it writes where the offsets are bad."""
    spec = PackedFillSpec(params_type)
    return KernelStep(spec, spec.grid(rows, 2 * row_elements), (spec.num_threads, 1, 1), 0)


def error_word_slot(params: ParamsTemplate) -> int:
    """The slot of AttnParams' ``error_flags``, the device error word that ``_launch.run`` binds
    per call (``_workspace.device_error_word``: no synchronisation, no host read), for the plans
    whose kernels check device-side values: cu_seqlens and seqused_k (packed sequences), cache
    lengths and page ids (the cache kernels)."""
    return params.slot("error_flags")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


LAYOUT_AXES = {"bshd": (0, 1, 2), "bhsd": (0, 2, 1), "thd": (-1, 0, 1)}  # (batch, row, head)


def mask_flags(p: Problem) -> _dispatch.MaskFlags:
    """The variant flags of a call."""
    return _dispatch.MaskFlags(
        p.causal_bound, p.local_bound, p.softcap > 0, p.dropout_p > 0, p.alibi != ALIBI_NONE, mask=p.mask
    )


def filled_output(output: Output) -> Output:
    """An output no kernel writes: rows that see no key (O = 0, LSE = -inf)."""
    return replace(output, fill=-math.inf if output.name == "lse" else 0.0)
