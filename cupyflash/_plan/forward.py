"""The forward's planner (``attention``, ``attention_varlen``, paged ``attention_varlen``):
FA2 (mma.sync) or the Hopper kernel, and the split-KV decode kernel where ``plan_attention``
finds it applies."""

from __future__ import annotations

import math
from dataclasses import replace

from .. import _dispatch
from .._device import DeviceInfo
from .._mods import KernelMods
from .._params import PARAMS_STRUCTS
from .._specs import (
    DECODE_MAX_QUERIES,
    HOPPER_ARCH,
    MAX_HEAD_DIM,
    Fa2FwdSpec,
    Fa3FwdSpec,
)
from .._validate import ALIBI_NONE, KvCacheProblem, Problem
from .block_mask import BlockCells
from .common import (
    LAYOUT_AXES,
    STRIDE_NAMES,
    attn_fields,
    check_gpu_dtypes,
    check_grid,
    check_head_dim,
    check_int32,
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
from .decode import plan_kvcache
from .model import INDEX, KernelStep, Launch, Operand, Output, Scratch, Temporary, TmaMaps


# ---------------------------------------------------------------------------------------------
# The forward (attention, attention_varlen): FA2 (mma.sync) or the Hopper kernel.
# ---------------------------------------------------------------------------------------------
def forward_spec(
    p: Problem, dtype: str, device: DeviceInfo, algorithm: str, packed: bool, mods: KernelMods | None = None,
    batch_invariant: bool = False,
) -> Fa2FwdSpec | Fa3FwdSpec:  # fmt: skip
    """fa3 on Hopper where it applies (and fits), else the mma.sync FA2 kernel; ``packed``
    (varlen) picks the fa3 variant that reads each sequence's rows from cu_seqlens. ``mods``: a
    user score_mod / mask_mod, compiled into the chosen kernel's score hook.

    Neither kernel splits a sequence's keys: one CTA computes each (query block, batch, head)
    tile over all its keys, in one order; the Hopper kernel's persistent or dynamic schedule
    only decides which CTA computes which tile. So a sequence's result is the same in any batch
    once the variant is; the variant follows the dtype, head dim, mask flags and key count,
    which for packed sequences is the batch's longest: ``batch_invariant`` keeps it out."""
    check_head_dim(p.head_dim, "the GPU kernels")
    flags = mask_flags(p)
    source = ""
    if mods is not None:
        if algorithm not in ("auto", "fa2", "fa3"):
            raise ValueError(
                f"score_mod / mask_mod run on the FA2 or the Hopper kernel: use algorithm='auto', 'fa2' or 'fa3', not "
                f"{algorithm!r}"
            )
        if flags.softcap or flags.dropout or flags.alibi or p.mask:
            raise ValueError(
                "on the GPU, score_mod / mask_mod do not combine with softcap, dropout or ALiBi yet: write the softcap "
                "or the bias into score_mod (softcap: lambda s, b, h, q, kv: c * mods.tanh(s / c))"
            )
        source = mods.source
    fa2_only = flags.dropout or p.seqused_k or bool(p.mask)
    if fa2_only and algorithm == "fa3":
        raise ValueError(
            "algorithm='fa3' (the Hopper kernel) has no dropout, attn_mask or seqused_k: use algorithm='fa2' or 'auto'"
        )
    if algorithm in ("fa3", "auto") and not fa2_only:
        hopper = device.arch == HOPPER_ARCH
        chosen = algorithm == "fa3"
        spec = (
            _dispatch.fa3_fwd_spec(
                dtype,
                p.head_dim,
                flags,
                p.seqlen_k,
                packed,
                chosen=chosen,
                mods_source=source,
                batch_invariant=batch_invariant,
            )  # fmt: skip
            if hopper
            else None
        )
        if spec is not None and spec.smem_bytes <= device.max_smem_per_block:
            return spec
        if algorithm == "fa3":
            limit = f" up to {_dispatch.FA3_MODS_MAX_HEAD_DIM} with score_mod / mask_mod" if source else ""
            raise ValueError(
                "algorithm='fa3' (wgmma + TMA) needs a Hopper GPU (sm_90) and a head_dim that is a multiple of "
                f"8{limit}; this call has head_dim={p.head_dim} on {device.arch}: use algorithm='fa2' or 'auto'"
            )
    if source:
        flags = replace(flags, mask="mods")
    return _dispatch.fa2_fwd_spec(dtype, p.head_dim, flags, device.max_smem_per_block, mods_source=source)


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
    mods: KernelMods | None = None,
    batch_invariant: bool = False,
    cells: BlockCells | None = None,
) -> Launch:
    """One forward kernel over a padded batch (``p.layout`` "bshd"/"bhsd") or packed sequences
    (``packed_rows`` = the packed totals (total_q, total_k): each tile finds its rows in
    cu_seqlens, batch strides 0; rows outside every sequence are 0 with LSE -inf). ``mods``: a
    user score_mod / mask_mod (FA2), its captured arrays operands mod_buffer0, 1, ...; ``cells``:
    its BlockMask's summary (its layout fixed here, its buffers operands mask_cells,
    mask_key_ranges, mask_row_ranges); ``batch_invariant``: the variant not chosen by the batch
    (``forward_spec``)."""
    check_grid(p.batch, p.heads_q)
    packed = packed_rows is not None
    scale_log2, prescale, negate_q = softmax_factors(p)
    axes = LAYOUT_AXES["thd" if packed else p.layout]
    rows = packed_rows if packed_rows is not None else (p.seqlen_q, p.seqlen_k)
    has_work = p.batch > 0 and p.seqlen_q > 0 and p.heads_q > 0
    # No key: O = 0 and LSE = -inf with no kernel, but a sink's LSE is its own logit: the FA2
    # kernel then runs over no key block (its epilogue adds the sink).
    no_keys = p.seqlen_k == 0 and not packed
    if no_keys and p.sinks:
        algorithm = "fa2"
    spec = forward_spec(p, dtype, device, algorithm, packed, mods, batch_invariant) if has_work else None
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
    if packed:
        fixed.update(packed_max_fields(p))
    if mods is not None:
        fixed.update(mods_scale_fields(mods, scale_log2))
    if cells is not None:
        assert mods is not None, "a BlockMask's summary comes with its mask_mod"
        fixed.update(cells.fields)
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
            fixed["lpt_pairs"] = _dispatch.fa3_fwd_lpt_pairs(
                spec.causal, rows[1] // max(p.batch, 1) if packed else rows[1], spec.head_dim,
                p.heads_q // max(p.heads_kv, 1), p.batch * p.heads_q,
            )  # fmt: skip
        steps += (step,)
        if packed:  # first: the rows no sequence owns, in place of a fill of the whole output
            steps = (packed_fill_step(struct.c_name, rows[0], p.heads_q * p.head_dim), *steps)
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
    if mods is not None:
        operands += mods_operands(params, mods)
    if cells is not None:
        operands += BlockCells.operands(params)
    outputs: tuple[Output, ...] = (
        Output("out", tuple(q_shape), dtype, params.slot("o_ptr")),
        Output("lse", lse_shape, "float32", params.slot("lse_ptr"), optional=True),
    )
    if not has_work or (no_keys and not p.sinks):  # no key: O = 0, LSE = -inf, no kernel
        outputs = tuple(filled_output(o) for o in outputs)
        steps, scratch, temporaries = (), None, ()
    error_slot = error_word_slot(params) if packed else -1  # the kernels check cu_seqlens, seqused_k
    return Launch(
        params, tuple(operands), outputs, steps, temporaries=temporaries, scratch=scratch, error_slot=error_slot
    )


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
        outputs = tuple(filled_output(o) for o in outputs)
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


def plan_attention(
    p: Problem, dtype: str, device: DeviceInfo, algorithm: str, q_shape: tuple[int, ...],
    mods: KernelMods | None = None, batch_invariant: bool = False, cells: BlockCells | None = None,
) -> Launch:  # fmt: skip
    """``attention`` on the GPU with the flash kernels ("auto", "fa2", "fa3", "decode"; the
    baselines are ``_baselines_gpu.plan_baseline``). "auto" runs one-token queries on the decode
    kernel (K and V read once per KV head, split over the SMs), the rest on the Hopper kernel
    where it applies, else on FA2. ``batch_invariant``: the decode kernel's splits of a fixed
    size in keys (``plan_kvcache``), not a count from the batch's occupancy."""
    if mods is not None:
        return plan_forward(
            p, dtype, device, algorithm, q_shape=q_shape, mods=mods, batch_invariant=batch_invariant, cells=cells
        )
    one_token = algorithm == "auto" and p.seqlen_q == 1 and p.seqlen_k > 0
    if algorithm == "decode" or (one_token and decode_applies(p)):
        if not decode_applies(p):
            raise ValueError(
                f"algorithm='decode' takes 1 to {DECODE_MAX_QUERIES} query tokens, head_dim up to {MAX_HEAD_DIM}, "
                f"no dropout or ALiBi; this call has {p.seqlen_q} query tokens, head_dim={p.head_dim}"
            )
        kp = KvCacheProblem(p, paged=False, page_size=p.seqlen_k, num_pages=p.batch, capacity=p.seqlen_k, seqlen_new=0)
        return plan_kvcache(
            kp, {"q": dtype}, device, num_splits=0, layout=p.layout, dense=True, batch_invariant=batch_invariant
        )
    return plan_forward(p, dtype, device, algorithm, q_shape=q_shape, batch_invariant=batch_invariant)
