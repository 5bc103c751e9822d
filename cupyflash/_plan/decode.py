"""The cache call's planner (``attention_with_kvcache``, FlashDecoding): the append of k_new /
v_new (with rotary) and the split-KV decode kernel, over contiguous, paged and float8 caches."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _dispatch
from .._device import DeviceInfo
from .._fp8 import Fp8Cache
from .._params import PARAMS_STRUCTS, ParamsTemplate
from .._specs import (
    DECODE_MAX_QUERIES,
    DECODE_MAX_TREE_QUERIES,
    DECODE_TREE_WORD_QUERIES,
    FP8_DECODE_HEAD_DIMS,
    FP8_KV_FORMATS,
    DecodeAppendSpec,
    DecodeSpec,
    RotaryQSpec,
)
from .._validate import ALIBI_NONE, BATCH_INVARIANT_SPLITS, KvCacheProblem
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
    mask_flags,
    softmax_factors,
    tile_kind,
    tile_operand,
)
from .model import CONTIGUOUS, FP8_TILE, INDEX, LENGTHS, SCALAR, KernelStep, Launch, Operand, Output, Scratch, Temporary


# ---------------------------------------------------------------------------------------------
# Decoding over a KV cache (FlashDecoding) and merge_states.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CascadePrefix:
    """The shared prefixes of a one-launch cascade (``attention_with_shared_prefix``): requests
    ``groups[g] .. groups[g + 1] - 1`` attend prefix g's keys, pages of the same pool through a
    table of ``table_pages`` pages per prefix (operand "prefix_block_table", lengths
    "prefix_seqlens": an int or a device array), before their own."""

    groups: tuple[int, ...]
    table_pages: int


def plan_kvcache(
    kp: KvCacheProblem,
    dtypes: dict[str, str | None],
    device: DeviceInfo,
    *,
    num_splits: int,
    layout: str = "bshd",
    dense: bool = False,
    fp8: Fp8Cache | None = None,
    batch_invariant: bool = False,
    cascade: CascadePrefix | None = None,
) -> Launch:
    """At most two launches: append k_new / v_new into the cache, then the attention: the split-KV
    kernel for up to DECODE_MAX_QUERIES query tokens (its last split of each row to finish merges
    the partials: no combine launch), else (or with ALiBi) the FA2 forward over the cache view.

    ``num_splits``: 0 picks the count from the occupancy of the whole launch (batch, KV heads,
    capacity); ``batch_invariant``: splits of BATCH_INVARIANT_SPLIT_KEYS keys instead, enough to
    cover the capacity, each sequence merging only those that hold its keys (``split_ranges``).
    The FA2 kernel over the cache splits no keys: it is batch-invariant either way.

    ``dense``: ``attention`` of a few query tokens over k and v (operands "q", "k", "v" in
    ``layout``, every sequence ``attn.seqlen_k`` keys long) on the split-KV kernel.
    ``fp8``: float8 caches (dequantised by the split-KV kernel, k_new / v_new quantised by the
    append; operands "k_scale" / "v_scale": a per-call host float, or a float32 device array).
    ``kp.tree``: a bool tree mask among the draft tokens (operand "tree_mask", read by the
    split-KV kernel's tree variant).
    ``cascade``: the requests' shared prefixes, read in the same launch (``_cascade_step``; the
    call must fit it: ``cascade_spec`` not None).
    """
    a = kp.attn
    if batch_invariant and num_splits:
        raise ValueError(BATCH_INVARIANT_SPLITS)
    if kp.tree:
        _check_tree_call(kp, dtypes.get("tree_mask"))
    if cascade is not None:
        _check_cascade_call(kp, fp8 is not None or batch_invariant or dense)
    skip = (*INDEX_NAMES, "tree_mask") if fp8 is None else (*INDEX_NAMES, "tree_mask", "k_cache", "v_cache")
    dtype = check_gpu_dtypes({n: d for n, d in dtypes.items() if d is not None and n not in skip})
    check_int32({n: dtypes.get(n) for n in INDEX_NAMES})
    check_head_dim(a.head_dim, "the decode kernels")
    if kp.capacity >= 2**31 - 64:
        raise ValueError(f"a cache of {kp.capacity} tokens per sequence is beyond the kernels' int32 positions")
    most_queries = DECODE_MAX_TREE_QUERIES if kp.tree else DECODE_MAX_QUERIES
    over_cache = not dense and (a.seqlen_q > most_queries or a.alibi != ALIBI_NONE)
    if dense and a.seqlen_q > DECODE_MAX_QUERIES:
        raise ValueError(f"the split-KV kernel takes 1 to {DECODE_MAX_QUERIES} query tokens, got {a.seqlen_q}")
    if fp8 is not None:
        _check_fp8_call(kp, over_cache)
    check_grid(a.batch, a.heads_q if over_cache else a.heads_kv)
    scale_log2, prescale, negate_q = softmax_factors(a)
    has_work = a.batch > 0 and a.seqlen_q > 0 and a.heads_q > 0
    d, hq, nq = a.head_dim, a.heads_q, a.seqlen_q
    splits, per_split, ctas = 1, 0, 0
    prefix_fields: dict[str, int] = {}
    if over_cache:
        fa2 = _dispatch.fa2_fwd_spec(dtype, d, mask_flags(a), device.max_smem_per_block, over_cache=True)
        grid = (-(-nq // fa2.tile.block_m), a.batch, hq)
        attention_step = KernelStep(fa2, grid, (fa2.num_threads, 1, 1), fa2.smem_bytes)
    else:
        group = a.heads_q // a.heads_kv
        rows = group * a.seqlen_q
        if cascade is None:
            spec = _dispatch.decode_spec(
                dtype, a.head_dim, rows, a.causal_bound, a.local_bound, a.softcap > 0, fp8=fp8 is not None,
                batch_invariant=batch_invariant, tree=kp.tree, wide_tree=kp.tree and nq > DECODE_TREE_WORD_QUERIES,
            )  # fmt: skip
        else:
            spec = _cascade_spec(kp, cascade, dtype, device.arch)
        m_blocks = -(-rows // spec.tile.block_m)
        key_blocks = -(-kp.capacity // spec.tile.block_n)
        ctas = a.batch * a.heads_kv * m_blocks
        if batch_invariant:  # the split size fixed, the count whatever covers the capacity
            per_split = _dispatch.BATCH_INVARIANT_SPLIT_KEYS // spec.tile.block_n
            splits = -(-max(key_blocks, 1) // per_split)
        else:
            if num_splits == 0 and has_work:
                num_splits = _dispatch.decode_num_splits(
                    ctas=ctas,
                    key_blocks=key_blocks,
                    num_sms=device.num_sms,
                    ctas_per_sm=_dispatch.ctas_per_sm(spec, device),
                )
            per_split, splits = _dispatch.split_blocks(key_blocks, max(num_splits, 1))
        grid = (splits * m_blocks, a.heads_kv, a.batch)
        if cascade is not None:
            prefix_fields, grid = _cascade_step(kp, cascade, spec, device, splits)
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
        cache_batch=a.batch if kp.paged else kp.num_pages, **prefix_fields,
        **({} if fp8 is None else {
            "kv_fp8": FP8_KV_FORMATS[fp8.format], "k_scale": 1.0, "v_scale": 1.0,
            "k_scale_head_stride": int(fp8.k_scale == "head"), "v_scale_head_stride": int(fp8.v_scale == "head"),
        }),
        **({} if not kp.rotary_half else {
            **rotated_q, "rotary_half": kp.rotary_half, "rotary_interleaved": int(kp.rotary_interleaved),
            "rotary_q_per_token": int(kp.rotary_q_per_token), "rotary_max_cached": kp.rotary_max_cached,
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
                int_rotary=(kp.rotary_rows, kp.rotary_max_cached) if kp.rotary_half else None,
            ),  # fmt: skip
        ]
    if kp.batch_idx:
        operands.append(Operand("cache_batch_idx", INDEX, params.slot("cache_batch_idx")))
    if kp.leftpad:
        operands.append(Operand("cache_leftpad", INDEX, params.slot("cache_leftpad")))
    if kp.tree_mask_shape is not None:  # (Nq, Nq) or (1, Nq, Nq): one tree for the batch, batch stride 0
        shape = kp.tree_mask_shape
        strides = [(params.slot("tree_mask_row_stride"), len(shape) - 2)]
        if len(shape) == 3 and shape[0] > 1:
            strides.append((params.slot("tree_mask_batch_stride"), 0))
        operands.append(Operand("tree_mask", INDEX, params.slot("tree_mask"), tuple(strides)))
    if cascade is not None:
        operands += _prefix_operands(params, prefix_fields["prefix_capacity"])
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
        # A cascade's partials: each request's own splits, then its prefix's (every one written).
        parts = splits + prefix_fields.get("prefix_splits", 0)
        if parts > 1:  # the splits' tickets (left at 0 by the kernel), partial O (rows of the tile's width), LSE
            row_count, width = a.batch * a.heads_q * a.seqlen_q, spec.head_dim
            scratch = Scratch(
                4 * ctas, 4 * row_count * (width + 1) * parts, params.slot("split_counters"),
                ((params.slot("o_partial_ptr"), 0), (params.slot("lse_partial_ptr"), 4 * row_count * width * parts)),
            )  # fmt: skip
    lse_shape = (a.batch, a.heads_q, a.seqlen_q)
    outputs: tuple[Output, ...] = (
        Output("out", out_shape, dtype, params.slot("o_ptr")),
        Output("lse", lse_shape, "float32", params.slot("lse_ptr"), optional=True),
    )
    if not has_work:
        outputs = tuple(filled_output(o) for o in outputs)
    error_slot = -1 if dense else error_word_slot(params)
    return Launch(params, tuple(operands), outputs, tuple(steps), temporaries, scratch=scratch, error_slot=error_slot)


def split_ranges(launch: Launch, seqlen_k: int) -> tuple[tuple[int, int], ...]:
    """The key ranges ``[begin, end)`` whose partials the split-KV kernel of ``launch`` merges for a
    sequence of ``seqlen_k`` keys (counted from its first attended key), in the order it merges
    them: decode_partial's ``sequence_splits`` and its split bounds, in Python (no window: a
    window only empties the leading ones). One range for one split (written directly, no merge);
    () where the attention is not the split-KV kernel."""
    step = next((s for s in launch.steps if isinstance(s.spec, DecodeSpec)), None)
    if step is None:
        return ()
    block_n, spec = step.spec.tile.block_n, step.spec
    splits, per_split = launch.params.value("num_splits"), launch.params.value("blocks_per_split")
    keys = per_split * block_n
    if spec.batch_invariant:
        splits = min(splits, max(1, -(-seqlen_k // keys)))
    return tuple((min(s * keys, seqlen_k), min((s + 1) * keys, seqlen_k)) for s in range(int(splits)))


def cascade_row_blocks(groups: tuple[int, ...], per_block: int) -> tuple[tuple[int, int, int], ...]:
    """The prefixes' row blocks of a one-launch cascade, in the order of the kernel's
    ``prefix_rows`` (DecodeParams): (prefix g, first request, one past its last), at most
    ``per_block`` requests of one group each (an empty group has none)."""
    return tuple(
        (g, first, min(first + per_block, end))
        for g, (begin, end) in enumerate(zip(groups, groups[1:]))
        for first in range(begin, end, per_block)
    )


def cascade_blocks(launch: Launch, groups: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``cascade_row_blocks`` of a cascade Launch: what its "prefix_rows" operand holds."""
    step = next(s for s in launch.steps if isinstance(s.spec, DecodeSpec))
    params = launch.params
    per_request = int(params.value("h_h_k_ratio")) * int(params.value("seqlen_q"))
    return cascade_row_blocks(groups, step.spec.prefix_rows // max(per_request, 1))


def _cascade_spec(kp: KvCacheProblem, cascade: CascadePrefix, dtype: str, arch: str) -> DecodeSpec:
    a = kp.attn
    group_rows = max((e - b for b, e in zip(cascade.groups, cascade.groups[1:])), default=0)
    per_request = a.heads_q // a.heads_kv * a.seqlen_q
    spec = _dispatch.cascade_spec(dtype, a.head_dim, per_request, group_rows * per_request, a.causal_bound,
                                  a.softcap > 0, arch)  # fmt: skip
    if spec is None:
        raise ValueError(
            f"a one-launch cascade takes a request's {per_request} packed rows (query tokens x GQA group) in one "
            f"tile of head_dim {a.head_dim}: too many"
        )
    return spec


def _cascade_step(
    kp: KvCacheProblem, cascade: CascadePrefix, spec: DecodeSpec, device: DeviceInfo, own_splits: int
) -> tuple[dict[str, int], tuple[int, int, int]]:
    """The prefix fields of DecodeParams and the grid of a one-launch cascade: the prefixes' row
    blocks x their splits, then each request's ``own_splits``, times the KV heads (decode.cu's
    decode_work)."""
    a = kp.attn
    per_request = max(a.heads_q // a.heads_kv * a.seqlen_q, 1)
    blocks = cascade_row_blocks(cascade.groups, spec.prefix_rows // per_request)
    capacity = cascade.table_pages * (1 << kp.page_size_log2)
    key_blocks = -(-capacity // spec.tile.block_n)
    prefix_splits = _dispatch.cascade_prefix_splits(
        prefix_ctas=len(blocks) * a.heads_kv, key_blocks=key_blocks, num_sms=device.num_sms,
        ctas_per_sm=_dispatch.ctas_per_sm(spec, device), own_splits=own_splits,
    )  # fmt: skip
    per_split, prefix_splits = _dispatch.split_blocks(key_blocks, prefix_splits)
    fields = {
        "prefix_capacity": capacity, "num_prefix_blocks": len(blocks), "prefix_splits": prefix_splits,
        "prefix_blocks_per_split": per_split,
    }  # fmt: skip
    ctas = (prefix_splits * len(blocks) + a.batch * own_splits) * a.heads_kv
    if ctas >= 2**31:
        raise ValueError(f"a one-launch cascade of {ctas} CTAs is beyond a grid's x extent")
    return fields, (ctas, 1, 1)


def _prefix_operands(params: ParamsTemplate, capacity: int) -> list[Operand]:
    """A cascade's prefix table, its lengths (an int for every prefix, checked per call against the
    table's ``capacity``, or an int32 device array, checked by the kernel) and the host-built row
    blocks (``cascade_row_blocks``)."""
    return [
        Operand("prefix_block_table", INDEX, params.slot("prefix_block_table"),
                ((params.slot("prefix_block_table_batch_stride"), 0),)),
        Operand("prefix_seqlens", LENGTHS, params.slot("prefix_seqlens"), int_slot=params.slot("prefix_seqlen"),
                int_limit=(capacity, 0)),
        Operand("prefix_rows", INDEX, params.slot("prefix_rows")),
    ]  # fmt: skip


def _check_cascade_call(kp: KvCacheProblem, other_variant: bool) -> None:
    """A one-launch cascade runs the split-KV kernel's cascade variant over a paged 16-bit cache:
    1 to DECODE_MAX_QUERIES query tokens, no window, ALiBi, sinks, rotary, tree, float8 cache or
    fixed split size (``attention_with_shared_prefix`` passes none of them)."""
    a = kp.attn
    if not kp.paged or a.seqlen_q > DECODE_MAX_QUERIES or other_variant:
        raise ValueError(f"a one-launch cascade takes a paged 16-bit cache and 1 to {DECODE_MAX_QUERIES} query tokens")
    if a.local_bound or a.alibi != ALIBI_NONE or a.sinks or kp.rotary_half or kp.tree or kp.batch_idx or kp.leftpad:
        raise ValueError("a one-launch cascade takes no window, ALiBi, sinks, rotary, tree mask or cache index")


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


def _check_tree_call(kp: KvCacheProblem, dtype: str | None) -> None:
    """A tree mask runs on the split-KV decode kernel (1 to DECODE_MAX_TREE_QUERIES query tokens:
    one bit word per row), and is a bool array (the kernel reads its bytes)."""
    if kp.attn.seqlen_q > DECODE_MAX_TREE_QUERIES:
        raise ValueError(
            f"tree_mask on the GPU takes 1 to {DECODE_MAX_TREE_QUERIES} query tokens (a 64-bit word of visible "
            f"drafts per row in the split-KV decode kernel), got {kp.attn.seqlen_q}"
        )
    if dtype != "bool":
        raise TypeError(f"tree_mask must be a bool array, got {dtype}")


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


INDEX_NAMES = ("cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad")
