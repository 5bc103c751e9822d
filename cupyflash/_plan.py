"""Pure plans: a validated problem and a ``DeviceInfo`` in, a ``Launch`` out.

A ``Launch`` is everything a call needs that depends only on shapes, dtypes, options and the
device: the steps (kernel variant, grid, block, shared memory; the naive baseline's cuBLAS
GEMMs), the operands it reads and how their pointers and strides enter the kernel's params
struct (by field name), the outputs it allocates, the per-stream scratch it needs, and the
params struct's fixed fields (a template). Planning compiles nothing and asks the driver
nothing beyond the cached ``DeviceInfo``; ``_launch.run`` executes a Launch, and a kernel is
compiled where a Launch first meets it (``_kernels.get_kernel``).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from . import _dispatch, _interop
from ._fp8 import Fp8Cache
from ._params import PARAMS_STRUCTS, ParamsTemplate
from ._specs import (
    CUDA_ELEMENT_TYPES,
    DECODE_MAX_QUERIES,
    FP8_DECODE_HEAD_DIMS,
    FP8_KV_FORMATS,
    HOPPER_ARCH,
    MAX_HEAD_DIM,
    BwdRowSpec,
    DecodeAppendSpec,
    Fa2FwdSpec,
    Fa3FwdSpec,
    KernelSpec,
    MaskCellsSpec,
    MergeSpec,
    RotaryQSpec,
)
from ._validate import ALIBI_BATCH_HEAD, ALIBI_NONE, KvCacheProblem, Problem
from .xp_impl import Dropout


# ---------------------------------------------------------------------------------------------
# The device, read once.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    arch: str  # NVRTC target: "sm_90a" on Hopper, else "sm_XY"
    num_sms: int
    max_smem_per_block: int  # opt-in dynamic shared memory of one CTA
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int


@functools.cache
def device_info(index: int) -> DeviceInfo:
    from ._kernels import device_arch

    attr = functools.partial(_interop.device_attribute, index)
    return DeviceInfo(
        index=index,
        arch=device_arch(index),
        num_sms=attr("MultiProcessorCount"),
        max_smem_per_block=attr("MaxSharedMemoryPerBlockOptin"),
        smem_per_sm=attr("MaxSharedMemoryPerMultiprocessor"),
        regs_per_sm=attr("MaxRegistersPerMultiprocessor"),
        max_threads_per_sm=attr("MaxThreadsPerMultiProcessor"),
        max_blocks_per_sm=attr("MaxBlocksPerMultiprocessor"),
    )


# ---------------------------------------------------------------------------------------------
# What a Launch is made of.
# ---------------------------------------------------------------------------------------------
TILE = "tile"  # a 16-bit tensor the kernels read in 16-byte chunks (unit stride on head_dim)
ROWS = "rows"  # one read element by element (a head dim not a multiple of 8: unit stride on it)
FP8_TILE = "fp8_tile"  # a float8 cache (bytes) the kernels read in 16-byte chunks (unit stride on head_dim)
INDEX = "index"  # an int32 array read element by element (unit stride on its last axis)
CONTIGUOUS = "contiguous"  # read as one C-contiguous block (merge_states' parts)
LENGTHS = "lengths"  # cache_seqlens: an int32 array, or one int for every sequence
SCALAR = "scalar"  # a per-call int (the dropout seed) into its field: ptr_slot


@dataclass(frozen=True, slots=True)
class Operand:
    """One input array and where its pointer and strides go in the params struct."""

    name: str
    kind: str = TILE
    ptr_slot: int = -1
    stride_slots: tuple[tuple[int, int], ...] = ()  # (params slot, array axis)
    in_place: bool = False  # written by the kernels: cannot be copied to make it readable
    negate: bool = False  # a negative scale runs as |scale| on -q
    int_slot: int = -1  # LENGTHS: the params slot of an int given for every sequence
    int_limit: tuple[int, int] = (0, 0)  # LENGTHS: (capacity, seqlen_new) an int is checked against
    offset_of: tuple[int, str, int] | None = None  # (slot, base operand, element bytes): ptr distance


@dataclass(frozen=True, slots=True)
class Output:
    name: str  # "out" | "lse"
    shape: tuple[int, ...]
    dtype: str
    ptr_slot: int
    fill: float | None = None  # the value rows no kernel writes keep (None: every element written)
    optional: bool = False  # allocated only when returned (the LSE)


@dataclass(frozen=True, slots=True)
class Temporary:
    """A per-call buffer the steps pass to a kernel or a GEMM (FA1's HBM state, naive's S, P),
    or whose pointer goes to a params slot (the backward's dQ accumulator)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ptr_slot: int = -1


@dataclass(frozen=True, slots=True)
class Scratch:
    """Per-stream device memory (``_workspace``): counters that read 0 and are left at 0, then
    scratch with no initial value; their pointers go to the named slots."""

    counter_bytes: int
    scratch_bytes: int
    counter_slot: int
    scratch_slots: tuple[tuple[int, int], ...] = ()  # (params slot, byte offset in the scratch)


@dataclass(frozen=True, slots=True)
class TmaMaps:
    """A Hopper kernel's tensor maps (the forward's q, k, v; the backward's q, k, v, dout), in the
    order of its params struct, encoded per call from the operands of those names."""

    dtype: str
    axes: tuple[int, int, int]  # (row, head, batch) axes of the operands; -1: batch stride 0
    # Per map: (operand name, (d, rows, heads, batch) innermost first, box rows).
    maps: tuple[tuple[str, tuple[int, int, int, int], int], ...]


@dataclass(frozen=True, slots=True)
class KernelStep:
    spec: KernelSpec
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    tma: TmaMaps | None = None
    buffers: tuple[str, ...] = ()  # temporaries passed after the params struct


@dataclass(frozen=True)
class Launch:
    params: ParamsTemplate
    operands: tuple[Operand, ...]
    outputs: tuple[Output, ...]
    steps: tuple[Any, ...] = ()  # KernelStep, or a step with .execute(call) (the naive GEMMs)
    temporaries: tuple[Temporary, ...] = ()
    scratch: Scratch | None = None
    error_slot: int = -1  # the params slot of the device error word (``error_word_slot``), or -1
    # The steps' compiled kernels, filled by the Launch's first run (``_launch``); never planned.
    kernels: list[Any] = field(default_factory=list, repr=False, compare=False)
    # Derived on construction: operands by name (TMA maps and pointer offsets look them up).
    operand_index: dict[str, int] = field(init=False, repr=False, compare=False)

    # The layouts last found readable by the kernels (``_launch``: a call whose operands have
    # the same raw strides checks only their pointers' alignment), in a one-item list: threads
    # share a Launch, so the item is replaced whole, never edited. It holds, per operand, the raw
    # strides (None: none yet, or not ``plain`` below) and the element strides, and the params
    # values with those operands' strides in their slots (a call starts from these values).
    layouts: list[tuple[tuple[Any, ...], tuple[Any, ...], tuple[int | float, ...]]] = field(
        init=False, repr=False, compare=False
    )

    # Per operand, what a call's straight path needs, flat: (index, name, the pointer's slot, the
    # pointer's alignment mask: 15 for a TILE (16 bytes), 0 for the others). ``plain``: neither
    # negated nor given as an offset (only these take the straight path).
    bindings: tuple[tuple[int, str, int, int], ...] = field(init=False, repr=False, compare=False)
    plain: tuple[bool, ...] = field(init=False, repr=False, compare=False)
    # Whether a call keeps each operand's (pointer, strides): the TMA maps, a pointer offset and
    # the steps that launch themselves read them.
    needs_bound: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.operands)
        object.__setattr__(self, "operand_index", {op.name: i for i, op in enumerate(self.operands)})
        object.__setattr__(self, "layouts", [((None,) * n, (None,) * n, self.params.values)])
        bindings = tuple(
            (i, op.name, op.ptr_slot, 15 if op.kind in (TILE, FP8_TILE) else 0) for i, op in enumerate(self.operands)
        )
        object.__setattr__(self, "bindings", bindings)
        object.__setattr__(self, "plain", tuple(not op.negate and op.offset_of is None for op in self.operands))
        needs_bound = any(op.offset_of is not None for op in self.operands) or any(
            type(step) is not KernelStep or step.tma is not None for step in self.steps
        )
        object.__setattr__(self, "needs_bound", needs_bound)


# ---------------------------------------------------------------------------------------------
# One cache helper for every entry point, one eviction rule.
# ---------------------------------------------------------------------------------------------
PlanT = TypeVar("PlanT")


class PlanCache(Generic[PlanT]):
    """Launches (or an entry point's tuple of them) by call signature. A process that meets
    endlessly new shapes starts over when the cache is full (no LRU bookkeeping on the hot path);
    a key that cannot be hashed (an argument of an unhashable type) is planned without caching."""

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: dict[Any, PlanT] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], PlanT]) -> PlanT:
        try:
            hit = self._entries.get(key)
        except TypeError:
            return make()
        if hit is None:
            hit = make()
            with self._lock:
                if len(self._entries) >= self.MAX_ENTRIES:
                    self._entries.clear()
                self._entries[key] = hit
        return hit

    def lookup(self, key: Any) -> PlanT | None:
        """The cached Launch, or None (a miss, or a key that cannot be hashed): the hot path's
        check before it builds a planning closure."""
        try:
            return self._entries.get(key)
        except TypeError:
            return None

    def clear(self) -> None:
        self._entries.clear()

    def values(self) -> list[PlanT]:
        return list(self._entries.values())


ALL_CACHES: list[PlanCache[Any]] = []


def new_cache() -> PlanCache[Launch]:
    cache: PlanCache[Launch] = PlanCache()
    ALL_CACHES.append(cache)
    return cache


def new_pair_cache() -> PlanCache[tuple[Launch, Launch]]:
    """A cache of two Launches a call runs in order (the FP8 forward's)."""
    cache: PlanCache[tuple[Launch, Launch]] = PlanCache()
    ALL_CACHES.append(cache)
    return cache


def clear_caches() -> None:
    """Forget every plan (the tuning scripts change the tile tables between measurements)."""
    for cache in ALL_CACHES:
        cache.clear()


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
DQ_TILE_ROWS = 64  # the Hopper backward's dQacc tiles (kDqTileRows, kernels_cu/dq_tiles.cuh)


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
    """The per-call operands of the FA2 kernels' options: the dropout seed (an int the entry point
    draws or is given), the fp32 ALiBi slopes (Hq,) (batch stride 0) or (B, Hq), seqused_k, an
    attn_mask."""
    operands = []
    if p.dropout_p > 0:
        operands.append(Operand("dropout_seed", SCALAR, params.slot("dropout_seed")))
    if p.alibi != ALIBI_NONE:
        strides = ((params.slot("alibi_batch_stride"), 0),) if p.alibi == ALIBI_BATCH_HEAD else ()
        operands.append(Operand("alibi_slopes", INDEX, params.slot("alibi_slopes"), strides))
    if p.seqused_k:
        operands.append(Operand("seqused_k", INDEX, params.slot("seqused_k")))
    if p.mask:  # (B|1, Hq|1, Nq|1, Nk|1): a broadcast axis keeps stride 0
        axes = enumerate(("batch", "head", "row", "key"))
        mask_strides = tuple((params.slot(f"bias_{n}_stride"), a) for a, n in axes if p.mask_shape[a] > 1)
        operands.append(Operand("attn_mask", INDEX, params.slot("bias_ptr"), mask_strides))
    return operands


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


# ---------------------------------------------------------------------------------------------
# The forward (attention, attention_varlen): FA2 (mma.sync) or the Hopper kernel.
# ---------------------------------------------------------------------------------------------
LAYOUT_AXES = {"bshd": (0, 1, 2), "bhsd": (0, 2, 1), "thd": (-1, 0, 1)}  # (batch, row, head)


def mask_flags(p: Problem) -> _dispatch.MaskFlags:
    """The variant flags of a call."""
    return _dispatch.MaskFlags(
        p.causal_bound, p.local_bound, p.softcap > 0, p.dropout_p > 0, p.alibi != ALIBI_NONE, mask=p.mask
    )


def forward_spec(p: Problem, dtype: str, device: DeviceInfo, algorithm: str, packed: bool) -> Fa2FwdSpec | Fa3FwdSpec:
    """fa3 on Hopper where it applies (and fits), else the mma.sync FA2 kernel; ``packed``
    (varlen) picks the fa3 variant that reads each sequence's rows from cu_seqlens."""
    check_head_dim(p.head_dim, "the GPU kernels")
    flags = mask_flags(p)
    fa2_only = flags.dropout or flags.alibi or p.seqused_k or bool(p.mask)
    if fa2_only and algorithm == "fa3":
        raise ValueError(
            "algorithm='fa3' (the Hopper kernel) has no dropout, ALiBi or seqused_k: use algorithm='fa2' or 'auto'"
        )
    if algorithm in ("fa3", "auto") and not fa2_only:
        hopper = device.arch == HOPPER_ARCH
        chosen = algorithm == "fa3"
        spec = _dispatch.fa3_fwd_spec(dtype, p.head_dim, flags, p.seqlen_k, packed, chosen=chosen) if hopper else None
        if spec is not None and spec.smem_bytes <= device.max_smem_per_block:
            return spec
        if algorithm == "fa3":
            raise ValueError(
                "algorithm='fa3' (wgmma + TMA) needs a Hopper GPU (sm_90) and a head_dim that is a multiple of 8; "
                f"this call has head_dim={p.head_dim} on {device.arch}: use algorithm='fa2' or 'auto'"
            )
    return _dispatch.fa2_fwd_spec(dtype, p.head_dim, flags, device.max_smem_per_block)


def fa3_grid(spec: Fa3FwdSpec, tiles: int, device: DeviceInfo) -> tuple[int, int, int]:
    """The Hopper forward's grid over ``tiles`` query tiles: uniform tiles (or tiles drawn from
    the dynamic schedule's counter) are walked by one persistent CTA per SM, uneven ones get a
    CTA each."""
    if tiles >= 2**31:
        raise ValueError(f"{tiles} query tiles exceed the kernel's 32-bit tile counter")
    return (min(tiles, device.num_sms) if spec.persistent else tiles, 1, 1)


def plan_forward(
    p: Problem,
    dtype: str,
    device: DeviceInfo,
    algorithm: str,
    *,
    q_shape: tuple[int, ...],
    packed_rows: tuple[int, int] | None = None,
) -> Launch:
    """One forward kernel over a padded batch (``p.layout`` "bshd"/"bhsd") or packed sequences
    (``packed_rows`` = the packed totals (total_q, total_k): each tile finds its rows in
    cu_seqlens, batch strides 0; rows outside every sequence are 0 with LSE -inf)."""
    check_grid(p.batch, p.heads_q)
    packed = packed_rows is not None
    scale_log2, prescale, negate_q = softmax_factors(p)
    axes = LAYOUT_AXES["thd" if packed else p.layout]
    rows = packed_rows if packed_rows is not None else (p.seqlen_q, p.seqlen_k)
    has_work = p.batch > 0 and p.seqlen_q > 0 and p.heads_q > 0
    spec = forward_spec(p, dtype, device, algorithm, packed) if has_work else None
    struct = PARAMS_STRUCTS["Fa3Params" if isinstance(spec, Fa3FwdSpec) else "AttnParams"]

    # Outputs are fresh contiguous arrays of q's shape; LSE (B, Hq, Nq), or (Hq, total_q) packed.
    out_strides = contiguous_strides(q_shape)
    if packed:
        lse_shape: tuple[int, ...] = (p.heads_q, rows[0])
        lse_strides = (0, rows[0])
    else:
        lse_shape = (p.batch, p.heads_q, p.seqlen_q)
        lse_strides = (p.heads_q * p.seqlen_q, p.seqlen_q)
    fixed: dict[str, int | float] = {
        **attn_fields(p, rows, scale_log2, prescale),
        **{f"o_{s}_stride": out_strides[a] if a >= 0 else 0 for s, a in zip(STRIDE_NAMES, axes, strict=True)},
        "lse_batch_stride": lse_strides[0],
        "lse_head_stride": lse_strides[1],
    }
    steps: tuple[KernelStep, ...] = ()
    scratch = None
    cells_shape: tuple[int, ...] = ()
    if spec is not None:
        block = (spec.num_threads, 1, 1)
        if isinstance(spec, Fa2FwdSpec):
            step = KernelStep(spec, (-(-p.seqlen_q // spec.tile.block_m), p.batch, p.heads_q), block, spec.smem_bytes)
            if p.mask:  # its block summary first: the kernel skips the tiles it hides
                cell_fields, cells_shape, cells_step = mask_cells(
                    p, dtype, [(spec.tile.block_m, spec.tile.block_n)], "AttnParams"
                )
                fixed.update(cell_fields)
                steps = (cells_step,)
        else:
            assert spec.varlen == packed, f"{spec.name} on {'packed' if packed else 'padded'} inputs"
            m_blocks = -(-p.seqlen_q // spec.block_m)
            grid = fa3_grid(spec, m_blocks * p.batch * p.heads_q, device)
            batches = 1 if packed else p.batch
            q_dims, kv_dims = (p.head_dim, rows[0], p.heads_q, batches), (p.head_dim, rows[1], p.heads_kv, batches)
            maps = (("q", q_dims, spec.block_m), ("k", kv_dims, spec.block_n), ("v", kv_dims, spec.block_n))
            tma = TmaMaps(dtype, (axes[1], axes[2], axes[0]), maps)
            step = KernelStep(spec, grid, block, spec.smem_bytes, tma=tma)
            fixed["num_m_blocks"] = m_blocks
        steps += (step,)
    params = struct.template(**fixed)
    temporaries = (
        (Temporary("mask_cells", (math.prod(cells_shape),), "uint8", params.slot("mask_cells")),) if cells_shape else ()
    )
    if isinstance(spec, Fa3FwdSpec) and spec.tile.dynamic:
        # The dynamic schedule's tile counters: the stream's pair, 0 between launches.
        scratch = Scratch(8, 0, params.slot("tile_counters"))
    kind = tile_kind(p.head_dim)
    operands = [
        tile_operand(params, "q", axes, negate=negate_q, kind=kind),
        tile_operand(params, "k", axes, kind=kind),
        tile_operand(params, "v", axes, kind=kind),
    ]
    if packed:
        operands += [
            Operand("cu_seqlens_q", INDEX, params.slot("cu_seqlens_q")),
            Operand("cu_seqlens_k", INDEX, params.slot("cu_seqlens_k")),
        ]
    operands += fa2_option_operands(params, p)
    outputs: tuple[Output, ...] = (
        Output("out", tuple(q_shape), dtype, params.slot("o_ptr"), fill=0.0 if packed else None),
        Output("lse", lse_shape, "float32", params.slot("lse_ptr"), fill=-math.inf if packed else None, optional=True),
    )
    if not has_work or (p.seqlen_k == 0 and not packed):  # no key: O = 0, LSE = -inf, no kernel
        outputs = tuple(_filled(o) for o in outputs)
        steps, scratch, temporaries = (), None, ()
    error_slot = error_word_slot(params) if packed else -1  # the kernels check cu_seqlens, seqused_k
    return Launch(
        params, tuple(operands), outputs, steps, temporaries=temporaries, scratch=scratch, error_slot=error_slot
    )


#: A descale factor's form (``plan_fp8_forward``) -> its (batch, head) strides in the array.
DESCALE_STRIDES = {"tensor": (0, 0), "head": (0, 1)}  # "batch_head": (heads_kv, 1); "host": no array


def plan_fp8_forward(
    p: Problem, out_dtype: str, device: DeviceInfo, q_shape: tuple[int, ...], descales: dict[str, str]
) -> tuple[Launch, Launch]:
    """The FP8 forward (e4m3 q, k, v; the Hopper kernel): two Launches, run in order.

    1. V's transpose (fp8_vt.cu): operand "v", output "vt" -- [B, d, Hkv, Nk_pad] for "bshd" q / k
       ([B, Hkv, d, Nk_pad] for "bhsd": the axes of q's rows, heads and batch are then Vt's d,
       heads and batch), Nk_pad = seqlen_k rounded up to 128, its keys permuted inside every 32
       and zero past seqlen_k;
    2. attention (fa3_fwd.cu with E4m3Inputs): operands "q", "k" and "v" (the first Launch's vt),
       the descale factors, outputs "out" (``out_dtype``) and "lse".
    ``descales``: per name (q_descale, k_descale, v_descale), "host" (a float into its field per
    call; 1.0 when not given) or the form of a float32 device array: "tensor" (() or (1,)),
    "head" ((Hkv,)) or "batch_head" ((B, Hkv), C-contiguous).
    """
    check_grid(p.batch, p.heads_q)
    scale_log2, prescale, negate_q = softmax_factors(p)
    assert not negate_q, "checked by the entry point: a negative scale is refused"
    has_work = p.batch > 0 and p.seqlen_q > 0 and p.heads_q > 0 and p.seqlen_k > 0
    vt_spec, spec = _dispatch.fp8_fwd_specs(out_dtype, p.head_dim, p.causal_bound)
    d, keys = p.head_dim, -(-p.seqlen_k // vt_spec.keys_per_block) * vt_spec.keys_per_block
    axes = LAYOUT_AXES[p.layout]
    batch, row, head = axes
    # Vt's shape puts d, the KV heads and the batch on the axes q's rows, heads and batch take.
    vt_shape = [0, 0, 0, keys]
    vt_shape[row], vt_shape[head], vt_shape[batch] = d, p.heads_kv, p.batch
    vt_strides = contiguous_strides(tuple(vt_shape))

    vt_params = PARAMS_STRUCTS["AttnParams"].template(
        **attn_fields(p, (p.seqlen_q, p.seqlen_k), scale_log2, prescale),
        **{f"o_{s}_stride": vt_strides[a] for s, a in zip(STRIDE_NAMES, axes, strict=True)},
    )
    vt_steps = (
        (KernelStep(vt_spec, (keys // vt_spec.keys_per_block, p.heads_kv, p.batch), (vt_spec.num_threads, 1, 1),
                    vt_spec.smem_bytes),) if has_work else ()
    )  # fmt: skip
    transpose = Launch(
        vt_params,
        (tile_operand(vt_params, "v", axes, kind=FP8_TILE),),
        (Output("vt", tuple(vt_shape), "uint8", vt_params.slot("o_ptr")),),
        vt_steps,
    )

    out_strides = contiguous_strides(q_shape)
    m_blocks = -(-p.seqlen_q // spec.block_m)
    fixed: dict[str, int | float] = {
        **attn_fields(p, (p.seqlen_q, p.seqlen_k), scale_log2, prescale),
        **{f"o_{s}_stride": out_strides[a] for s, a in zip(STRIDE_NAMES, axes, strict=True)},
        "lse_batch_stride": p.heads_q * p.seqlen_q,
        "lse_head_stride": p.seqlen_q,
        "num_m_blocks": m_blocks,
        **{name: 1.0 for name in descales},
    }
    for name, form in descales.items():
        if form != "host":
            batch_stride, head_stride = DESCALE_STRIDES.get(form, (p.heads_kv, 1))
            fixed.update({f"{name}_batch_stride": batch_stride, f"{name}_head_stride": head_stride})
    params = PARAMS_STRUCTS["Fa3Params"].template(**fixed)
    grid = fa3_grid(spec, m_blocks * p.batch * p.heads_q, device)
    q_dims = (d, p.seqlen_q, p.heads_q, p.batch)
    k_dims = (d, p.seqlen_k, p.heads_kv, p.batch)
    vt_dims = (keys, d, p.heads_kv, p.batch)  # keys innermost; a box is 128 keys x all of d
    maps = (("q", q_dims, spec.block_m), ("k", k_dims, spec.block_n), ("v", vt_dims, d))
    tma = TmaMaps("float8", (row, head, batch), maps)
    steps = (KernelStep(spec, grid, (spec.num_threads, 1, 1), spec.smem_bytes, tma=tma),)
    operands = [tile_operand(params, name, axes, kind=FP8_TILE) for name in ("q", "k", "v")]
    for name, form in descales.items():  # a host number into its field, an array by pointer
        host = form == "host"
        operands.append(Operand(name, SCALAR if host else CONTIGUOUS, params.slot(name if host else f"{name}_ptr")))
    outputs: tuple[Output, ...] = (
        Output("out", tuple(q_shape), out_dtype, params.slot("o_ptr")),
        Output("lse", (p.batch, p.heads_q, p.seqlen_q), "float32", params.slot("lse_ptr"), optional=True),
    )
    scratch = Scratch(8, 0, params.slot("tile_counters")) if spec.tile.dynamic else None
    if not has_work:  # no key (or no query): O = 0, LSE = -inf, no kernel
        outputs = tuple(_filled(o) for o in outputs)
        return transpose, Launch(params, tuple(operands), outputs)
    return transpose, Launch(params, tuple(operands), outputs, steps, scratch=scratch)


def plan_backward(
    p: Problem,
    dtype: str,
    device: DeviceInfo,
    *,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    packed_rows: tuple[int, int] | None = None,
    deterministic: bool = False,
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
    kernel over query blocks instead of fp32 atomics (two of the five products computed twice)."""
    check_grid(p.batch, p.heads_q)
    check_head_dim(p.head_dim, "the GPU backward kernels")
    packed = packed_rows is not None
    scale_log2, prescale, negate_q = softmax_factors(p)
    axes = LAYOUT_AXES["thd" if packed else p.layout]
    rows = packed_rows if packed_rows is not None else (p.seqlen_q, p.seqlen_k)
    has_work = p.batch > 0 and p.heads_q > 0 and rows[0] > 0 and rows[1] > 0
    flags = mask_flags(p)
    hopper = None
    if device.arch == HOPPER_ARCH and not p.seqused_k:
        hopper = _dispatch.fa3_bwd_spec(dtype, p.head_dim, flags, deterministic, packed)
        if hopper is not None and hopper.smem_bytes > device.max_smem_per_block:
            hopper = None
    spec = _dispatch.fa2_bwd_spec(dtype, p.head_dim, flags, deterministic)
    if hopper is None and spec.smem_bytes > device.max_smem_per_block:
        raise ValueError(
            f"the GPU backward at head_dim={p.head_dim} needs {spec.smem_bytes} bytes of shared memory per block; "
            f"this GPU has {device.max_smem_per_block}"
        )

    # Per-row temporaries: row r of query head h, batch b at b * row_batch + h * row_head + r.
    # The Hopper kernel's: each (b, h)'s rows padded to whole steps (block_m: one or two 64-row
    # dQacc tiles; the steps' -LSE log2 e and D rows read whole).
    padded_q = -(-p.seqlen_q // hopper.block_m) * hopper.block_m if hopper is not None else p.seqlen_q
    if packed:
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
        dq_spec = _dispatch.fa2_bwd_dq_spec(dtype, p.head_dim, flags)
        cell_tiles.append((dq_spec.block_m, dq_spec.block_n))
    cell_fields: dict[str, int] = {}
    if p.mask:  # its block summary, for both kernels' tiles: they skip the tiles it hides
        cell_fields, cells_shape, cells_step = mask_cells(p, dtype, cell_tiles, "BwdParams")
    params = PARAMS_STRUCTS["BwdParams"].template(
        **attn_fields(p, rows, scale_log2, prescale),
        **cell_fields,
        **output_strides,
        row_batch_stride=row_strides[0],
        row_head_stride=row_strides[1],
        dq_scale=p.scale,
        dk_scale=abs(p.scale) if negate_q else p.scale,
        dq_tiled=int(hopper is not None),
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
    if packed:
        operands += [
            Operand("cu_seqlens_q", INDEX, params.slot("cu_seqlens_q")),
            Operand("cu_seqlens_k", INDEX, params.slot("cu_seqlens_k")),
        ]
    fill = 0.0 if packed else None  # packed rows outside every sequence get no gradient
    outputs = (  # dq: every packed row written from the zeroed accumulator, but by dq_blocks only in sequences
        Output("dq", tuple(q_shape), dtype, params.slot("dq_ptr"), fill=fill if dq_kernel else None),
        Output("dk", tuple(k_shape), dtype, params.slot("dk_ptr"), fill=fill),
        Output("dv", tuple(k_shape), dtype, params.slot("dv_ptr"), fill=fill),
    )
    if not has_work:  # no query or no key: every gradient is 0
        return Launch(params, tuple(operands), tuple(_filled(o) for o in outputs))
    temporaries: tuple[Temporary, ...] = (
        Temporary("neg_lse_log2", (temp_rows,), "float32", params.slot("neg_lse_log2")),
        Temporary("dsum", (temp_rows,), "float32", params.slot("dsum")),
    )
    row_count = rows[0] if packed else padded_q
    row_block = (BwdRowSpec.num_threads, 1, 1)
    # Packed: the grids cover the totals, not max_seqlen_*: every sequence fits in its total, so
    # an understated maximum cannot leave keys without dK, dV or rows without dQ (the CTAs past
    # a sequence's end return at once).
    if hopper is not None:
        q_dims, kv_dims = (p.head_dim, p.seqlen_q, p.heads_q, p.batch), (p.head_dim, p.seqlen_k, p.heads_kv, p.batch)
        maps = (("q", q_dims, hopper.block_m), ("k", kv_dims, hopper.block_n), ("v", kv_dims, hopper.block_n),
                ("dout", q_dims, hopper.block_m))  # fmt: skip
        tma = TmaMaps(dtype, (axes[1], axes[2], axes[0]), maps)
        grid = (-(-rows[1] // hopper.block_n), p.batch, p.heads_kv)
        main = KernelStep(hopper, grid, (hopper.num_threads, 1, 1), hopper.smem_bytes, tma=tma)
    else:
        grid = (-(-rows[1] // spec.block_n), p.batch, p.heads_kv)
        main = KernelStep(spec, grid, (spec.num_threads, 1, 1), spec.smem_bytes)
    if dq_kernel:
        dq_grid = (-(-rows[0] // dq_spec.block_m), p.batch, p.heads_q)
        dq_step = KernelStep(dq_spec, dq_grid, (dq_spec.num_threads, 1, 1), dq_spec.smem_bytes)
    else:  # the accumulator the main kernel adds into, zeroed by prep, converted by the dq step
        convert = _dispatch.bwd_row_spec("dq", dtype, p.head_dim)  # rows of the tile's width
        temporaries += (Temporary("dq_accum", (temp_rows, convert.head_dim), "float32", params.slot("dq_accum")),)
        dq_step = KernelStep(convert, (convert.grid_x(row_count), batches, p.heads_q), row_block, 0)
        if hopper is not None and deterministic:  # its add count per 64-row tile, zeroed by prep
            tiles = temp_rows // DQ_TILE_ROWS  # (a 128-row step uses its first tile's)
            temporaries += (Temporary("dq_semaphore", (tiles,), "int32", params.slot("dq_semaphore")),)
    prep = _dispatch.bwd_row_spec("prep", dtype, p.head_dim)
    prep_step = KernelStep(prep, (prep.grid_x(row_count), batches, p.heads_q), row_block, 0)
    steps: tuple[KernelStep, ...] = (prep_step, main, dq_step)
    if p.mask:
        steps = (cells_step, *steps)
        temporaries += (Temporary("mask_cells", (math.prod(cells_shape),), "uint8", params.slot("mask_cells")),)
    error_slot = error_word_slot(params) if packed else -1  # the main kernel checks cu_seqlens, seqused_k
    return Launch(params, tuple(operands), outputs, steps, temporaries=temporaries, error_slot=error_slot)


def _filled(output: Output) -> Output:
    """An output no kernel writes: rows that see no key (O = 0, LSE = -inf)."""
    return replace(output, fill=-math.inf if output.name == "lse" else 0.0)


# ---------------------------------------------------------------------------------------------
# Decoding over a KV cache (FlashDecoding) and merge_states.
# ---------------------------------------------------------------------------------------------
def plan_kvcache(
    kp: KvCacheProblem,
    dtypes: dict[str, str | None],
    device: DeviceInfo,
    *,
    num_splits: int,
    layout: str = "bshd",
    dense: bool = False,
    fp8: Fp8Cache | None = None,
) -> Launch:
    """At most two launches: append k_new / v_new into the cache, then the attention: the split-KV
    kernel for up to DECODE_MAX_QUERIES query tokens (its last split of each row to finish merges
    the partials: no combine launch), else (or with ALiBi) the FA2 forward over the cache view.

    ``dense``: ``attention`` of a few query tokens over k and v (operands "q", "k", "v" in
    ``layout``, every sequence ``attn.seqlen_k`` keys long) on the split-KV kernel.
    ``fp8``: float8 caches (dequantised by the split-KV kernel, k_new / v_new quantised by the
    append; operands "k_scale" / "v_scale": a per-call host float, or a float32 device array).
    """
    a = kp.attn
    skip = _INDEX_NAMES if fp8 is None else (*_INDEX_NAMES, "k_cache", "v_cache")
    dtype = check_gpu_dtypes({n: d for n, d in dtypes.items() if d is not None and n not in skip})
    check_int32({n: dtypes.get(n) for n in _INDEX_NAMES})
    check_head_dim(a.head_dim, "the decode kernels")
    if kp.capacity >= 2**31 - 64:
        raise ValueError(f"a cache of {kp.capacity} tokens per sequence is beyond the kernels' int32 positions")
    over_cache = not dense and (a.seqlen_q > DECODE_MAX_QUERIES or a.alibi != ALIBI_NONE)
    if dense and a.seqlen_q > DECODE_MAX_QUERIES:
        raise ValueError(f"the split-KV kernel takes 1 to {DECODE_MAX_QUERIES} query tokens, got {a.seqlen_q}")
    if fp8 is not None:
        _check_fp8_call(kp, over_cache)
    check_grid(a.batch, a.heads_q if over_cache else a.heads_kv)
    scale_log2, prescale, negate_q = softmax_factors(a)
    has_work = a.batch > 0 and a.seqlen_q > 0 and a.heads_q > 0
    d, hq, nq = a.head_dim, a.heads_q, a.seqlen_q
    splits, per_split, ctas = 1, 0, 0
    if over_cache:
        fa2 = _dispatch.fa2_fwd_spec(dtype, d, mask_flags(a), device.max_smem_per_block, over_cache=True)
        grid = (-(-nq // fa2.tile.block_m), a.batch, hq)
        attention_step = KernelStep(fa2, grid, (fa2.num_threads, 1, 1), fa2.smem_bytes)
    else:
        group = a.heads_q // a.heads_kv
        rows = group * a.seqlen_q
        spec = _dispatch.decode_spec(
            dtype, a.head_dim, rows, a.causal_bound, a.local_bound, a.softcap > 0, fp8=fp8 is not None
        )
        m_blocks = -(-rows // spec.tile.block_m)
        key_blocks = -(-kp.capacity // spec.tile.block_n)
        ctas = a.batch * a.heads_kv * m_blocks
        if num_splits == 0 and has_work:
            num_splits = _dispatch.decode_num_splits(
                ctas=ctas,
                key_blocks=key_blocks,
                num_sms=device.num_sms,
                ctas_per_sm=_dispatch.ctas_per_sm(spec, device),
            )
        per_split, splits = _dispatch.split_blocks(key_blocks, max(num_splits, 1))
        grid = (splits * m_blocks, a.heads_kv, a.batch)
        attention_step = KernelStep(spec, grid, (spec.num_threads, 1, 1), spec.smem_bytes)
    axes = LAYOUT_AXES[layout]
    out_shape = (a.batch, nq, hq, d) if layout == "bshd" else (a.batch, hq, nq, d)
    out_strides = contiguous_strides(out_shape)
    # A rotary embedding: the attention reads q from a contiguous temporary the rotation fills.
    rotated_q = {f"q_{s}_stride": out_strides[axis] for s, axis in zip(STRIDE_NAMES, axes, strict=True)}
    params = PARAMS_STRUCTS["DecodeParams"].template(
        **attn_fields(a, (nq, a.seqlen_k if dense else 0), scale_log2, prescale),
        **{f"o_{s}_stride": out_strides[axis] for s, axis in zip(STRIDE_NAMES, axes, strict=True)},
        lse_batch_stride=hq * nq, lse_head_stride=nq,
        seqlen_new=kp.seqlen_new, page_size_log2=kp.page_size_log2, num_pages=kp.num_pages,
        cache_capacity=kp.capacity, num_splits=splits, blocks_per_split=per_split,
        cache_batch=a.batch if kp.paged else kp.num_pages,
        **({} if fp8 is None else {
            "kv_fp8": FP8_KV_FORMATS[fp8.format], "k_scale": 1.0, "v_scale": 1.0,
            "k_scale_head_stride": int(fp8.k_scale == "head"), "v_scale_head_stride": int(fp8.v_scale == "head"),
        }),
        **({} if not kp.rotary_half else {
            **rotated_q, "rotary_half": kp.rotary_half, "rotary_interleaved": int(kp.rotary_interleaved),
            "rotary_q_per_token": int(kp.rotary_q_per_token),
        }),
    )  # fmt: skip
    kind = tile_kind(d)
    temporaries: tuple[Temporary, ...] = ()
    if kp.rotary_half:  # the caller's q is read by the rotation only
        operands = [
            tile_operand(params, "q", axes, field_prefix="q_src", negate=negate_q, kind=kind),
            Operand("rotary_cos", CONTIGUOUS, params.slot("rotary_cos")),
            Operand("rotary_sin", CONTIGUOUS, params.slot("rotary_sin")),
        ]
        temporaries = (Temporary("q_rotated", out_shape, dtype, params.slot("q_ptr")),)
    else:
        operands = [tile_operand(params, "q", axes, negate=negate_q, kind=kind)]
    if dense:
        operands += [tile_operand(params, "k", axes, kind=kind), tile_operand(params, "v", axes, kind=kind)]
    else:
        operands += [
            *_cache_operands(params, kp, kind if fp8 is None else FP8_TILE),
            *([] if fp8 is None else _scale_operands(params, fp8)),
            Operand(
                "cache_seqlens",
                LENGTHS,
                params.slot("cache_seqlens"),
                int_slot=params.slot("seqlen_k"),
                int_limit=(kp.capacity, kp.seqlen_new),
            ),  # fmt: skip
        ]
    if kp.batch_idx:
        operands.append(Operand("cache_batch_idx", INDEX, params.slot("cache_batch_idx")))
    if kp.leftpad:
        operands.append(Operand("cache_leftpad", INDEX, params.slot("cache_leftpad")))
    operands += fa2_option_operands(params, a)  # ALiBi slopes (the FA2 path)
    steps: list[KernelStep] = []
    if kp.seqlen_new:
        operands += [
            tile_operand(params, "k_new", LAYOUT_AXES["bshd"], field_prefix="k_new", kind=kind),
            tile_operand(params, "v_new", LAYOUT_AXES["bshd"], field_prefix="v_new", kind=kind),
        ]
        if a.batch and a.heads_kv:
            append = DecodeAppendSpec(dtype, d, fp8=fp8 is not None)
            steps.append(KernelStep(append, (kp.seqlen_new, a.heads_kv, a.batch), (append.num_threads, 1, 1), 0))
    scratch = None
    if has_work:
        if kp.rotary_half:
            rotate = RotaryQSpec(dtype, d)
            steps.append(KernelStep(rotate, (nq, hq, a.batch), (rotate.num_threads, 1, 1), 0))
        steps.append(attention_step)
        if splits > 1:  # the splits' tickets (left at 0 by the kernel), partial O (rows of the tile's width), LSE
            row_count, width = a.batch * a.heads_q * a.seqlen_q, spec.head_dim
            scratch = Scratch(
                4 * ctas, 4 * row_count * (width + 1) * splits, params.slot("split_counters"),
                ((params.slot("o_partial_ptr"), 0), (params.slot("lse_partial_ptr"), 4 * row_count * width * splits)),
            )  # fmt: skip
    lse_shape = (a.batch, a.heads_q, a.seqlen_q)
    outputs: tuple[Output, ...] = (
        Output("out", out_shape, dtype, params.slot("o_ptr")),
        Output("lse", lse_shape, "float32", params.slot("lse_ptr"), optional=True),
    )
    if not has_work:
        outputs = tuple(_filled(o) for o in outputs)
    error_slot = -1 if dense else error_word_slot(params)
    return Launch(params, tuple(operands), outputs, tuple(steps), temporaries, scratch=scratch, error_slot=error_slot)


def _check_fp8_call(kp: KvCacheProblem, over_cache: bool) -> None:
    """A float8 cache runs on the split-KV decode kernel only (the FA2 kernel over a cache reads
    16-bit tiles), at head dims FP8_DECODE_HEAD_DIMS."""
    a = kp.attn
    if over_cache:
        why = "ALiBi (which runs on the FA2 kernel)" if a.alibi != ALIBI_NONE else f"{a.seqlen_q} query tokens"
        raise ValueError(
            f"a float8 KV cache runs on the split-KV decode kernel: 1 to {DECODE_MAX_QUERIES} query tokens and no "
            f"ALiBi; this call has {why} (dequantise the cache, or split the queries into chunks of "
            f"{DECODE_MAX_QUERIES})"
        )
    if a.head_dim not in FP8_DECODE_HEAD_DIMS:
        raise ValueError(f"a float8 KV cache on the GPU takes head_dim {FP8_DECODE_HEAD_DIMS}, got {a.head_dim}")


def _scale_operands(params: ParamsTemplate, fp8: Fp8Cache) -> list[Operand]:
    """k_scale and v_scale: a host float into its field per call (the template holds 1.0 for a
    call that gives none), or a float32 device array (one value, or one per KV head) by pointer."""
    operands = []
    for name, form in (("k_scale", fp8.k_scale), ("v_scale", fp8.v_scale)):
        if form == "host":
            operands.append(Operand(name, SCALAR, params.slot(name)))
        else:
            operands.append(Operand(name, CONTIGUOUS, params.slot(f"{name}_ptr")))
    return operands


def _cache_operands(params: ParamsTemplate, kp: KvCacheProblem, kind: str) -> list[Operand]:
    """k_cache and v_cache (written in place by an append) and the block table of a paged cache:
    [entries or pages, rows, Hkv, d], the first axis's stride the entry's or the page's."""
    operands = [
        tile_operand(params, "k_cache", LAYOUT_AXES["bshd"], field_prefix="k", in_place=True, kind=kind),
        tile_operand(params, "v_cache", LAYOUT_AXES["bshd"], field_prefix="v", in_place=True, kind=kind),
    ]
    if kp.paged:
        operands.append(
            Operand("block_table", INDEX, params.slot("block_table"), ((params.slot("block_table_batch_stride"), 0),))
        )
    return operands


def plan_paged_varlen(
    p: Problem,
    dtypes: dict[str, str | None],
    device: DeviceInfo,
    q_shape: tuple[int, ...],
    table_shape: tuple[int, ...],
    num_pages: int,
) -> Launch:
    """attention_varlen with a block_table: the FA2 forward over the cache view, packed queries
    (cu_seqlens_q) against each sequence's pages, its key count from cu_seqlens_k (and
    seqused_k); operands "k" and "v" are the pages. Rows outside every sequence are 0, LSE -inf."""
    dtype = check_gpu_dtypes({n: dtypes[n] for n in ("q", "k", "v")})  # type: ignore[misc]
    check_int32({n: dtypes.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table")})
    check_head_dim(p.head_dim, "the GPU kernels")
    check_grid(p.batch, p.heads_q)
    capacity = table_shape[1] * p.page_size
    if capacity >= 2**31 - 64:
        raise ValueError(f"a block_table row of {capacity} keys is beyond the kernels' int32 positions")
    scale_log2, prescale, negate_q = softmax_factors(p)
    total_q = q_shape[0]
    axes = LAYOUT_AXES["thd"]
    out_strides = contiguous_strides(q_shape)
    params = PARAMS_STRUCTS["DecodeParams"].template(
        **attn_fields(p, (total_q, 0), scale_log2, prescale),
        **{f"o_{s}_stride": out_strides[a] if a >= 0 else 0 for s, a in zip(STRIDE_NAMES, axes, strict=True)},
        lse_batch_stride=0, lse_head_stride=total_q,
        page_size_log2=p.page_size.bit_length() - 1, num_pages=num_pages, cache_capacity=capacity, num_splits=1,
        cache_batch=p.batch,
    )  # fmt: skip
    kind = tile_kind(p.head_dim)
    operands = [
        tile_operand(params, "q", axes, negate=negate_q, kind=kind),
        tile_operand(params, "k", LAYOUT_AXES["bshd"], kind=kind),  # (page, slot, head)
        tile_operand(params, "v", LAYOUT_AXES["bshd"], kind=kind),
        Operand("block_table", INDEX, params.slot("block_table"), ((params.slot("block_table_batch_stride"), 0),)),
        Operand("cu_seqlens_q", INDEX, params.slot("cu_seqlens_q")),
        Operand("cu_seqlens_k", INDEX, params.slot("cu_seqlens_k")),
        *fa2_option_operands(params, p),
    ]
    outputs: tuple[Output, ...] = (
        Output("out", tuple(q_shape), dtype, params.slot("o_ptr"), fill=0.0),
        Output("lse", (p.heads_q, total_q), "float32", params.slot("lse_ptr"), fill=-math.inf, optional=True),
    )
    steps: tuple[KernelStep, ...] = ()
    if p.batch > 0 and p.seqlen_q > 0 and p.heads_q > 0:
        spec = _dispatch.fa2_fwd_spec(dtype, p.head_dim, mask_flags(p), device.max_smem_per_block, over_cache=True)
        grid = (-(-p.seqlen_q // spec.tile.block_m), p.batch, p.heads_q)
        steps = (KernelStep(spec, grid, (spec.num_threads, 1, 1), spec.smem_bytes),)
    else:
        outputs = tuple(_filled(o) for o in outputs)
    return Launch(params, tuple(operands), outputs, steps, error_slot=error_word_slot(params))


def decode_applies(p: Problem) -> bool:
    """The split-KV decode kernel computes this ``attention`` call: a few query tokens, no
    dropout and no ALiBi (causal is bottom-right, as the kernel's; windows and softcap as FA2's)."""
    return (
        0 < p.seqlen_q <= DECODE_MAX_QUERIES
        and 1 <= p.head_dim <= MAX_HEAD_DIM
        and p.dropout_p == 0
        and p.alibi == ALIBI_NONE
        and not p.mask
    )


def plan_attention(p: Problem, dtype: str, device: DeviceInfo, algorithm: str, q_shape: tuple[int, ...]) -> Launch:
    """``attention`` on the GPU with the flash kernels ("auto", "fa2", "fa3", "decode"; the
    baselines are ``_baselines_gpu.plan_baseline``). "auto" runs one-token queries on the decode
    kernel (K and V read once per KV head, split over the SMs), the rest on the Hopper kernel
    where it applies, else on FA2."""
    one_token = algorithm == "auto" and p.seqlen_q == 1 and p.seqlen_k > 0
    if algorithm == "decode" or (one_token and decode_applies(p)):
        if not decode_applies(p):
            raise ValueError(
                f"algorithm='decode' takes 1 to {DECODE_MAX_QUERIES} query tokens, head_dim up to {MAX_HEAD_DIM}, "
                f"no dropout or ALiBi; this call has {p.seqlen_q} query tokens, head_dim={p.head_dim}"
            )
        kp = KvCacheProblem(p, paged=False, page_size=p.seqlen_k, num_pages=p.batch, capacity=p.seqlen_k, seqlen_new=0)
        return plan_kvcache(kp, {"q": dtype}, device, num_splits=0, layout=p.layout, dense=True)
    return plan_forward(p, dtype, device, algorithm, q_shape=q_shape)


_INDEX_NAMES = ("cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad")


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
