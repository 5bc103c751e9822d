"""The pure planner on the CPU: what a Launch holds for each entry point, and the facts it takes
from tables instead of the driver (decode registers per thread: tests/test_compile.py checks them against ptxas)."""

from __future__ import annotations

import pytest

from cupyflash import _device, _dispatch, _interop, _kernels, _plan
from cupyflash._validate import attention_problem, kvcache_problem, varlen_problem

H200 = _device.HOPPER
A100 = _device.DeviceInfo(0, "sm_80", 108, 166912, 167936, 65536, 2048, 32)


def test_occupancy_model_on_the_h200():
    # d = 64, 16 rows: 119 registers x 256 threads bind (2 CTAs), before shared memory (3).
    spec = _dispatch.decode_spec("bfloat16", 64, 4, False)
    assert _dispatch.ctas_per_sm(spec, H200) == 2
    # d = 128: 135 KB of shared memory per CTA: one.
    assert _dispatch.ctas_per_sm(_dispatch.decode_spec("bfloat16", 128, 4, False), H200) == 1


def _dense(**kw):
    shapes = kw.pop("shapes", ((2, 300, 8, 128), (2, 333, 2, 128), (2, 333, 2, 128)))
    options = {"causal": False, "scale": None, "window": (-1, -1), "softcap": 0.0, "layout": "bshd", **kw}
    return attention_problem(*shapes, **options)


def test_forward_launch_fills_params_by_name():
    p = _dense(causal=True)
    launch = _plan.plan_forward(p, "bfloat16", H200, "fa2", q_shape=(2, 300, 8, 128))
    params = launch.params
    assert params.value("seqlen_q") == 300 and params.value("seqlen_k") == 333 and params.value("h_h_k_ratio") == 4
    assert params.value("window_right") == 0 and params.value("window_left") == -1
    assert params.value("o_row_stride") == 8 * 128 and params.value("lse_batch_stride") == 8 * 300
    q = launch.operands[launch.operand_index["q"]]
    assert q.ptr_slot == params.slot("q_ptr")
    assert dict(q.stride_slots) == {
        params.slot(f"q_{s}_stride"): a for s, a in zip(("batch", "row", "head"), (0, 1, 2))
    }
    (step,) = launch.steps
    assert step.grid == (-(-300 // step.spec.tile.block_m), 2, 8)


def test_plans_do_not_touch_the_device(monkeypatch):
    """Planning compiles nothing and asks the driver nothing: both would raise here."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the plan touched the device")

    monkeypatch.setattr(_kernels, "get_kernel", forbidden)
    monkeypatch.setattr(_interop, "device_attribute", forbidden)
    for algorithm in ("auto", "fa2", "fa3", "decode"):
        shapes = ((1, 1, 8, 128), (1, 4096, 2, 128), (1, 4096, 2, 128))
        _plan.plan_attention(_dense(shapes=shapes), "bfloat16", H200, algorithm, (1, 1, 8, 128))
    from cupyflash import _baselines_gpu

    for algorithm in ("fa1", "naive"):
        _baselines_gpu.plan_baseline(_dense(), "float16", H200, algorithm)
    kp = kvcache_problem(
        (4, 1, 8, 128), (64, 16, 2, 128), (64, 16, 2, 128), cache_seqlens=5, block_table_shape=(4, 16),
        k_new_shape=(4, 1, 2, 128), v_new_shape=(4, 1, 2, 128), causal=True, scale=None,
    )  # fmt: skip
    launch = _plan.plan_kvcache(kp, {"q": "bfloat16", "block_table": "int32"}, H200, num_splits=0)
    assert [s.spec.kernel for s in launch.steps] == ["decode_append", "decode_partial"]


def test_cache_calls_past_the_decode_kernel_run_fa2_over_the_cache():
    """More than DECODE_MAX_QUERIES query tokens, or ALiBi, on the cache call: the append, then the
    FA2 forward over the cache view (grid per query block, batch, query head); packed sequences
    over pages the same kernel alone."""
    import dataclasses

    from cupyflash._validate import ALIBI_HEAD, KvCacheProblem, varlen_problem

    def cache(nq: int) -> KvCacheProblem:
        return kvcache_problem(
            (4, nq, 8, 128), (64, 16, 2, 128), (64, 16, 2, 128), cache_seqlens=5, block_table_shape=(4, 16),
            k_new_shape=(4, nq, 2, 128), v_new_shape=(4, nq, 2, 128), causal=True, scale=None,
        )  # fmt: skip

    dtypes = {"q": "bfloat16", "block_table": "int32"}
    launch = _plan.plan_kvcache(cache(17), dtypes, H200, num_splits=0)
    assert [s.spec.kernel for s in launch.steps] == ["decode_append", "fa2_fwd_kvcache"]
    assert launch.steps[1].grid == (1, 4, 8) and launch.scratch is None and launch.error_slot >= 0
    alibi = cache(1)
    alibi = dataclasses.replace(alibi, attn=dataclasses.replace(alibi.attn, alibi=ALIBI_HEAD))
    launch = _plan.plan_kvcache(alibi, dtypes, H200, num_splits=0)
    assert launch.steps[1].spec.kernel == "fa2_fwd_kvcache" and launch.steps[1].spec.alibi
    packed = varlen_problem(
        (100, 8, 128), (64, 16, 2, 128), (64, 16, 2, 128), (5,), (5,), 60, 256, causal=True, scale=None,
        window=(-1, -1), softcap=0.0, block_table_shape=(4, 16),
    )  # fmt: skip
    index = dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "block_table"), "int32")
    launch = _plan.plan_paged_varlen(packed, {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16", **index}, H200,
                                     (100, 8, 128), (4, 16), 64)  # fmt: skip
    assert [s.spec.kernel for s in launch.steps] == ["fa2_fwd_kvcache"] and launch.steps[0].grid[1:] == (4, 8)


def test_auto_runs_one_token_queries_on_the_decode_kernel():
    one = _dense(shapes=((1, 1, 8, 128), (1, 4096, 2, 128), (1, 4096, 2, 128)))
    launch = _plan.plan_attention(one, "bfloat16", H200, "auto", (1, 1, 8, 128))
    assert [s.spec.kernel for s in launch.steps] == ["decode_partial"]
    windowed = _dense(shapes=((1, 1, 8, 128), (1, 4096, 2, 128), (1, 4096, 2, 128)), window=(100, 0), softcap=5.0)
    launch = _plan.plan_attention(windowed, "bfloat16", H200, "auto", (1, 1, 8, 128))
    spec = launch.steps[0].spec
    assert spec.kernel == "decode_partial" and spec.local and spec.softcap  # windows and softcap too
    dropout = _dense(shapes=((1, 1, 8, 128), (1, 4096, 2, 128), (1, 4096, 2, 128)), dropout_p=0.1)
    launch = _plan.plan_attention(dropout, "bfloat16", H200, "auto", (1, 1, 8, 128))
    assert [s.spec.kernel for s in launch.steps] == ["fa2_fwd"]
    with pytest.raises(ValueError, match="algorithm='decode' takes"):
        _plan.plan_attention(dropout, "bfloat16", H200, "decode", (1, 1, 8, 128))


def test_varlen_mask_does_not_depend_on_the_maxima():
    from cupyflash._validate import varlen_problem

    # max_seqlen_q = 1 would make a dense problem's causal bound "hide nothing".
    p = varlen_problem((9, 4, 64), (9, 4, 64), (9, 4, 64), (3,), (3,), 1, 8, causal=True, scale=None,
                       window=(-1, -1), softcap=0.0)  # fmt: skip
    assert p.causal_bound
    p = varlen_problem((60, 4, 64), (60, 4, 64), (60, 4, 64), (3,), (3,), 40, 8, causal=False, scale=None,
                       window=(10, 0), softcap=0.0)  # fmt: skip
    assert p.local_bound and p.causal_bound


def _problem(q, k, v, **kw):
    options = {"causal": False, "scale": None, "window": (-1, -1), "softcap": 0.0, "layout": "bshd", **kw}
    return attention_problem(q, k, v, **options)


def test_backward_plan_three_steps_and_the_scale_signs():
    """prep -> the key-block kernel -> dq; dq carries the signed scale, dk |scale| where q runs
    negated (no softcap) and the signed scale with softcap; dq's accumulator in a params slot."""
    p = _problem((2, 100, 8, 64), (2, 300, 2, 64), (2, 300, 2, 64), causal=True, scale=-0.5)
    launch = _plan.plan_backward(p, "bfloat16", A100, q_shape=(2, 100, 8, 64), k_shape=(2, 300, 2, 64))
    prep, main, dq = launch.steps
    assert (prep.spec.step, dq.spec.step) == ("prep", "dq") and main.spec.causal
    assert main.spec.kernel == "fa2_bwd" and launch.params.value("dq_tiled") == 0
    # d = 64: four rows per warp in prep, four pairs of rows (r, r + 8) per warp in dq
    assert main.grid == (-(-300 // main.spec.block_n), 2, 2) and prep.grid == (7, 2, 8)
    assert dq.grid == (-(-8 * 7 // 16), 2, 8)
    assert launch.params.value("dq_scale") == -0.5 and launch.params.value("dk_scale") == 0.5
    assert next(op for op in launch.operands if op.name == "q").negate
    assert [o.name for o in launch.outputs] == ["dq", "dk", "dv"]
    accum = next(t for t in launch.temporaries if t.name == "dq_accum")
    assert accum.shape == (2 * 8 * 100, 64) and accum.ptr_slot == launch.params.slot("dq_accum")
    # Hopper: fa3_bwd over 128-key blocks, its four maps, the rows padded to whole 64-row tiles
    # (prep's grid covers the padding rows, whose dQacc floats belong to the tiles).
    launch = _plan.plan_backward(p, "bfloat16", H200, q_shape=(2, 100, 8, 64), k_shape=(2, 300, 2, 64))
    prep, main, dq = launch.steps
    assert main.spec.kernel == "fa3_bwd" and main.spec.causal and main.grid == (3, 2, 2)
    assert [name for name, _, _ in main.tma.maps] == ["q", "k", "v", "dout"]
    assert launch.params.value("dq_tiled") == 1 and launch.params.value("row_head_stride") == 128
    assert prep.grid == (8, 2, 8) and dq.spec.step == "dq" and dq.grid == (4, 2, 8)
    accum = next(t for t in launch.temporaries if t.name == "dq_accum")
    assert accum.shape == (2 * 8 * 128, 64)
    # deterministic, Hopper: the same kernel adding into each tile in turn, a semaphore per tile
    det = _plan.plan_backward(p, "bfloat16", H200, q_shape=(2, 100, 8, 64), k_shape=(2, 300, 2, 64), deterministic=True)
    assert det.steps[1].spec.kernel == "fa3_bwd" and det.steps[1].spec.deterministic
    assert det.steps[1].grid == main.grid and det.steps[2].spec.step == "dq"
    assert det.steps[1].smem == det.steps[1].spec.smem_bytes > main.spec.smem_bytes  # staging two-deep
    semaphore = next(t for t in det.temporaries if t.name == "dq_semaphore")
    assert semaphore.shape == (2 * 8 * 2,) and semaphore.dtype == "int32"
    assert semaphore.ptr_slot == det.params.slot("dq_semaphore")
    assert "dq_semaphore" not in {t.name for t in launch.temporaries}
    # deterministic elsewhere: dQ from its own kernel over query blocks, no accumulator
    det = _plan.plan_backward(p, "bfloat16", A100, q_shape=(2, 100, 8, 64), k_shape=(2, 300, 2, 64), deterministic=True)
    assert det.steps[1].spec.deterministic and type(det.steps[2].spec).__name__ == "Fa2BwdDqSpec"
    assert det.steps[2].grid == (-(-100 // det.steps[2].spec.block_m), 2, 8)
    assert "dq_accum" not in {t.name for t in det.temporaries}  # no atomics, no accumulator
    capped = _problem((1, 10, 2, 64), (1, 10, 2, 64), (1, 10, 2, 64), scale=-0.5, softcap=3.0)
    launch = _plan.plan_backward(capped, "float16", H200, q_shape=(1, 10, 2, 64), k_shape=(1, 10, 2, 64))
    assert launch.params.value("dk_scale") == -0.5 and launch.steps[1].spec.softcap


def test_backward_plan_packed_and_empty():
    p = varlen_problem(
        (50, 4, 128), (70, 2, 128), (70, 2, 128), (4,), (4,), 30, 40, causal=True, scale=None, window=(-1, -1),
        softcap=0.0,
    )  # fmt: skip
    launch = _plan.plan_backward(p, "float16", A100, q_shape=(50, 4, 128), k_shape=(70, 2, 128), packed_rows=(50, 70))
    assert launch.params.value("row_batch_stride") == 0 and launch.params.value("row_head_stride") == 50
    # rows outside every sequence: no gradient, 0 from the first step (packed_fill.cu), no fill
    assert [o.fill for o in launch.outputs] == [None, None, None]
    fill = launch.steps[0]
    # (its grid: 70 rows of 4 x 128 elements, 2048 16-byte stores per CTA)
    assert fill.spec.kernel == "packed_fill" and fill.spec.params_type == "BwdParams" and fill.grid == (3, 1, 1)
    assert launch.params.value("max_seqlen_q") == 30 and launch.params.value("max_seqlen_k") == 40
    assert launch.steps[1].grid == (7, 1, 4)  # d = 128: two rows per warp
    # the key blocks cover the packed total (70 keys), whatever max_seqlen_k says: one block of 128
    assert launch.steps[2].grid == (1, 3, 2) and launch.params.value("grid_keys") == 0
    # seqused_k: the keys past a sequence's used ones are in no kernel's range: filled whole
    used = varlen_problem(
        (50, 4, 128), (70, 2, 128), (70, 2, 128), (4,), (4,), 30, 40, causal=True, scale=None, window=(-1, -1),
        softcap=0.0, seqused_k_shape=(3,),
    )  # fmt: skip
    launch = _plan.plan_backward(
        used, "float16", A100, q_shape=(50, 4, 128), k_shape=(70, 2, 128), packed_rows=(50, 70)
    )
    assert [o.fill for o in launch.outputs] == [None, 0.0, 0.0] and launch.steps[0].spec.kernel != "packed_fill"
    understated = varlen_problem(
        (50, 4, 128), (700, 2, 128), (700, 2, 128), (4,), (4,), 30, 40, causal=True, scale=None, window=(-1, -1),
        softcap=0.0,
    )  # fmt: skip
    det = _plan.plan_backward(understated, "float16", A100, q_shape=(50, 4, 128), k_shape=(700, 2, 128),
                              packed_rows=(50, 700), deterministic=True)  # fmt: skip
    assert det.steps[2].grid[0] == -(-700 // det.steps[2].spec.block_n)  # not 40 // block_n
    assert det.steps[3].grid[0] == -(-50 // det.steps[3].spec.block_m)  # not 30 // block_m
    # Hopper: fa3_bwd over packed sequences, each sequence's temporaries from a 128-aligned start
    # (a head's rows: (ceil(50 / 128) + 3 sequences) x 128), the per-row kernels over those rows,
    # the key blocks over max_seqlen_k (a longer sequence reported: grid_keys), maps over the
    # packed totals as one batch entry, and the rows outside every sequence written first
    launch = _plan.plan_backward(
        understated, "float16", H200, q_shape=(50, 4, 128), k_shape=(700, 2, 128), packed_rows=(50, 700)
    )
    fill, prep, main, dq = launch.steps
    assert fill.spec.kernel == "packed_fill" and fill.grid == (22, 1, 1)  # 700 rows of 4 x 128 elements
    assert main.spec.kernel == "fa3_bwd" and main.spec.varlen and main.spec.causal
    assert launch.params.value("dq_tiled") == 2 and launch.params.value("row_head_stride") == 512
    assert launch.params.value("row_batch_stride") == 0 and launch.params.value("grid_keys") == 128
    assert main.grid == (1, 3, 2) and prep.grid == (prep.spec.grid_x(512), 1, 4)
    assert dq.grid == (dq.spec.grid_x(512), 1, 4)
    q_map, kv_map = (128, 50, 4, 1), (128, 700, 2, 1)
    assert [dims for _, dims, _ in main.tma.maps] == [q_map, kv_map, kv_map, q_map]
    assert [o.fill for o in launch.outputs] == [None, None, None]
    accum = next(t for t in launch.temporaries if t.name == "dq_accum")
    assert accum.shape == (4 * 512, 128)
    det = _plan.plan_backward(understated, "float16", H200, q_shape=(50, 4, 128), k_shape=(700, 2, 128),
                              packed_rows=(50, 700), deterministic=True)  # fmt: skip
    assert det.steps[2].spec.varlen and det.steps[2].spec.deterministic
    assert next(t for t in det.temporaries if t.name == "dq_semaphore").shape == (4 * 512 // 64,)
    empty = _problem((1, 0, 2, 64), (1, 9, 2, 64), (1, 9, 2, 64))
    launch = _plan.plan_backward(empty, "float16", H200, q_shape=(1, 0, 2, 64), k_shape=(1, 9, 2, 64))
    assert not launch.steps and all(o.fill == 0.0 for o in launch.outputs)
    with pytest.raises(ValueError, match="head_dim from 1 to 256, got 264"):
        wide = _problem((1, 9, 2, 264), (1, 9, 2, 264), (1, 9, 2, 264))
        _plan.plan_backward(wide, "float16", H200, q_shape=(1, 9, 2, 264), k_shape=(1, 9, 2, 264))


def test_mask_plans_write_the_block_summary_first():
    """An attn_mask's launch starts with its block summary (kernels_cu/attn_mask.cuh): cells of the
    smallest tile over the rows and keys rounded up to the largest, stride 0 where the mask
    broadcasts; the backward's cells serve both of its kernels' tiles."""
    import dataclasses

    p = dataclasses.replace(_dense(causal=True), mask="bool", mask_shape=(2, 1, 1, 333))
    launch = _plan.plan_forward(p, "bfloat16", H200, "auto", q_shape=(2, 300, 8, 128))
    cells, fa2 = launch.steps
    assert type(cells.spec).__name__ == "MaskCellsSpec" and fa2.spec.mask == "bool"
    tile = fa2.spec.tile
    assert cells.grid == (-(-333 // tile.block_n), 1, 2)  # keys x one row cell (broadcast) x batch
    (summary,) = launch.temporaries
    assert summary.dtype == "uint8" and summary.shape == (2 * cells.grid[0],)
    assert summary.ptr_slot == launch.params.slot("mask_cells")
    value = launch.params.value
    strides = [value(f"mask_cells_{axis}_stride") for axis in ("batch", "head", "row", "key")]
    assert strides == [cells.grid[0], 0, 0, 1] and value("mask_heads") == 1
    assert 1 << value("mask_cell_keys_log2") == tile.block_n and 1 << value("mask_cell_rows_log2") == tile.block_m

    full = dataclasses.replace(_dense(), mask="additive", mask_shape=(1, 8, 300, 333))
    det = _plan.plan_backward(full, "bfloat16", H200, q_shape=(2, 300, 8, 128), k_shape=(2, 333, 2, 128),
                              deterministic=True)  # fmt: skip
    cells, _prep, main, dq = det.steps
    rows = min(main.spec.block_m, dq.spec.block_m)
    keys = min(main.spec.block_n, dq.spec.block_n)
    assert (1 << det.params.value("mask_cell_rows_log2"), 1 << det.params.value("mask_cell_keys_log2")) == (rows, keys)
    tile_rows, tile_keys = max(main.spec.block_m, dq.spec.block_m), max(main.spec.block_n, dq.spec.block_n)
    assert cells.grid == (-(-333 // tile_keys) * tile_keys // keys, -(-300 // tile_rows) * tile_rows // rows, 8)
    assert det.params.value("mask_cells_batch_stride") == 0 and det.params.value("mask_heads") == 8
