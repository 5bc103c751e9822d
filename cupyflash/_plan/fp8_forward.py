"""The FP8 forward's planner: V transposed (``fp8_vt.cu``), then the Hopper kernel on e4m3
inputs with its descale factors."""

from __future__ import annotations

from .. import _dispatch
from .._device import DeviceInfo
from .._params import PARAMS_STRUCTS
from .._validate import Problem
from .common import (
    LAYOUT_AXES,
    STRIDE_NAMES,
    attn_fields,
    check_grid,
    contiguous_strides,
    filled_output,
    softmax_factors,
    tile_operand,
)
from .forward import fa3_grid
from .model import CONTIGUOUS, FP8_TILE, SCALAR, KernelStep, Launch, Operand, Output, Scratch, TmaMaps

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
        outputs = tuple(filled_output(o) for o in outputs)
        return transpose, Launch(params, tuple(operands), outputs)
    return transpose, Launch(params, tuple(operands), outputs, steps, scratch=scratch)
