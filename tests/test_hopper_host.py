"""The Hopper kernel's host side on the CPU: which kernel a call gets, the tensor maps handed to
the driver, and the tile table's fit in shared memory."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest

from cupyflash import _device, _dispatch, _plan, _tma
from cupyflash._specs import FA3_HEAD_DIMS, Fa2FwdSpec, Fa3FwdSpec
from cupyflash._validate import attention_problem

H100_SMEM = _device.HOPPER.max_smem_per_block


def fake_device(arch: str) -> _device.DeviceInfo:
    """A device of a chosen arch with the H100/H200's shared memory per block."""
    return replace(_device.HOPPER, arch=arch)


def _problem(head_dim: int, causal: bool = False):
    shapes = ((2, 300, 8, head_dim), (2, 333, 2, head_dim), (2, 333, 2, head_dim))
    return attention_problem(*shapes, causal=causal, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")


@pytest.mark.parametrize("head_dim", (32, 40, 59, 64, 96, 128, 192, 224, 256))
def test_auto_picks_the_hopper_kernel_where_it_applies(head_dim):
    """The Hopper kernel at the next of its widths for head dims that are multiples of 8 (but
    32, which FA2 runs as fast at its own width); FA2 for the rest (element-by-element rows)."""
    device = fake_device("sm_90a")
    spec = _plan.forward_spec(_problem(head_dim), "bfloat16", device, "auto", packed=False)
    on_hopper = head_dim % 8 == 0 and head_dim > _dispatch.FA2_OVER_FA3_MAX_HEAD_DIM
    assert isinstance(spec, Fa3FwdSpec if on_hopper else Fa2FwdSpec)
    assert spec.head_dim >= head_dim and spec.valid_dim == (head_dim if head_dim != spec.head_dim else 0)
    assert not isinstance(spec, Fa3FwdSpec) or not spec.varlen
    # an explicit "fa2" runs the mma.sync kernel; packed sequences get the varlen variant
    assert isinstance(_plan.forward_spec(_problem(head_dim), "bfloat16", device, "fa2", packed=True), Fa2FwdSpec)
    packed = _plan.forward_spec(_problem(head_dim), "bfloat16", device, "auto", packed=True)
    if on_hopper:
        assert isinstance(packed, Fa3FwdSpec) and packed.varlen
        assert packed in _dispatch.all_fa3_fwd_specs() or packed.valid_dim  # warmup builds the full widths
        for is_packed in (False, True):  # an explicit "fa3" takes the variant of the layout too
            forced = _plan.forward_spec(_problem(head_dim), "bfloat16", device, "fa3", packed=is_packed)
            assert isinstance(forced, Fa3FwdSpec) and forced.varlen == is_packed
    else:
        assert isinstance(packed, Fa2FwdSpec)


def test_ampere_runs_fa2_and_refuses_fa3():
    device = fake_device("sm_80")
    assert isinstance(_plan.forward_spec(_problem(128), "float16", device, "auto", packed=False), Fa2FwdSpec)
    with pytest.raises(ValueError, match=r"algorithm='fa3'.*sm_80"):
        _plan.forward_spec(_problem(128), "float16", device, "fa3", packed=False)


def test_schedules_as_measured():
    """The schedules the H200 runs chose (docs/hopper.md): long uniform calls the static stride;
    causal d = 64 and 128 the dynamic one; causal d = 256 one CTA per tile (not persistent: a
    static stride straggles on uneven tiles)."""
    flags = _dispatch.MaskFlags
    long = _dispatch.FA3_SHORT_SEQLEN + 1
    for head_dim in FA3_HEAD_DIMS:
        uniform = _dispatch.fa3_fwd_spec("bfloat16", head_dim, flags(False, False, False), long)
        assert uniform.persistent and not uniform.tile.dynamic
    causal = {d: _dispatch.fa3_fwd_spec("bfloat16", d, flags(True, False, False), long) for d in FA3_HEAD_DIMS}
    assert causal[64].tile.dynamic and causal[128].tile.dynamic and causal[64].persistent
    assert not causal[256].tile.dynamic and not causal[256].persistent


def test_short_calls_take_their_own_tile():
    """Up to FA3_SHORT_SEQLEN keys a short-call tile applies where one is listed; longer calls,
    and head dims without one, take the general table; warmup builds both."""
    plain = _dispatch.MaskFlags(False, False, False)
    short, long = _dispatch.FA3_SHORT_SEQLEN, _dispatch.FA3_SHORT_SEQLEN + 1
    for head_dim in FA3_HEAD_DIMS:
        general = _dispatch.FA3_FWD_TILES[head_dim, False]
        expected = _dispatch.FA3_SHORT_FWD_TILES.get((head_dim, False), general)
        assert _dispatch.fa3_fwd_spec("float16", head_dim, plain, short).tile == expected
        assert _dispatch.fa3_fwd_spec("float16", head_dim, plain, long).tile == general
    assert _dispatch.fa3_fwd_spec("float16", 64, plain, 1024) in _dispatch.all_fa3_fwd_specs()
    assert _dispatch.fa3_fwd_spec("float16", 64, plain, 16384) in _dispatch.all_fa3_fwd_specs()


def test_short_calls_with_a_function_keep_their_own_tiles(monkeypatch):
    """A short call with a score or mask function takes FA3_MODS_SHORT_FWD_TILES whatever the
    plain short calls take (a mask function makes tiles uneven: the dynamic schedule there)."""
    three = _dispatch.Fa3Tile(128, consumers=3, stages=4)
    monkeypatch.setitem(_dispatch.FA3_SHORT_FWD_TILES, (64, False), three)
    plain = _dispatch.MaskFlags(False, False, False)
    short = _dispatch.FA3_SHORT_SEQLEN
    assert _dispatch.fa3_fwd_spec("bfloat16", 64, plain, short).tile == three
    with_mask = _dispatch.fa3_fwd_spec("bfloat16", 64, plain, short, mods_source="/* a function */")
    assert with_mask.tile == _dispatch.FA3_MODS_SHORT_FWD_TILES[64, False] and with_mask.tile.dynamic


def test_every_hopper_variant_fits_an_h100_block():
    specs = _dispatch.all_fa3_fwd_specs()
    assert {s.head_dim for s in specs} == set(FA3_HEAD_DIMS)
    assert all(s.smem_bytes <= H100_SMEM for s in specs)
    assert all(s.num_threads == 128 * (1 + s.tile.consumers) for s in specs)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_the_decoupled_backward_is_a_switch_and_compiles_cleanly(monkeypatch, head_dim):
    """Fa3BwdSpec.decoupled (the consumers meeting once a step): by default under the causal
    mask at d = 128 alone (_dispatch.FA3_BWD_DECOUPLED_CAUSAL), in the dispatcher and warmup
    alike; everywhere where _dispatch.FA3_BWD_DECOUPLED says so; never with deterministic=True
    (refused); its second dS^T buffer (keys x query rows, 16-bit) fits an H100 block; it builds
    for sm_90a with no spill, no serialised wgmma and no warning (causal over packed sequences,
    softcap)."""
    from cupyflash import _kernels
    from cupyflash._specs import Fa3BwdSpec

    causal, plain_flags = _dispatch.MaskFlags(True, False, False), _dispatch.MaskFlags(False, False, False)
    window = _dispatch.MaskFlags(True, True, False)
    by_default = head_dim == 128
    assert _dispatch.fa3_bwd_spec("bfloat16", head_dim, causal, False, False).decoupled == by_default
    assert _dispatch.fa3_bwd_spec("float16", head_dim, window, False, True).decoupled == by_default
    assert not _dispatch.fa3_bwd_spec("bfloat16", head_dim, causal, True, False).decoupled
    assert not _dispatch.fa3_bwd_spec("bfloat16", head_dim, plain_flags, False, False).decoupled
    warmup = _dispatch.all_fa3_bwd_specs()
    assert {s.decoupled for s in warmup if s.head_dim == head_dim and s.causal and not s.deterministic} == {by_default}
    assert not any(s.decoupled for s in warmup if s.head_dim == head_dim and not (s.causal and by_default))
    monkeypatch.setattr(_dispatch, "FA3_BWD_DECOUPLED_CAUSAL", False)
    assert not _dispatch.fa3_bwd_spec("bfloat16", head_dim, causal, False, False).decoupled
    monkeypatch.setattr(_dispatch, "FA3_BWD_DECOUPLED", True)
    assert _dispatch.fa3_bwd_spec("bfloat16", head_dim, causal, False, False).decoupled
    assert _dispatch.fa3_bwd_spec("bfloat16", head_dim, plain_flags, False, False).decoupled
    assert not _dispatch.fa3_bwd_spec("bfloat16", head_dim, causal, True, False).decoupled
    with pytest.raises(ValueError, match="default order"):
        Fa3BwdSpec("bfloat16", head_dim, deterministic=True, decoupled=True)
    plain = Fa3BwdSpec("bfloat16", head_dim)
    decoupled = Fa3BwdSpec("bfloat16", head_dim, decoupled=True)
    assert decoupled.smem_bytes == plain.smem_bytes + 2 * plain.block_n * plain.block_m <= H100_SMEM
    for spec in (Fa3BwdSpec("bfloat16", head_dim, causal=True, varlen=True, decoupled=True),
                 Fa3BwdSpec("float16", head_dim, softcap=True, decoupled=True)):  # fmt: skip
        build = _kernels.compile_offline(spec, "sm_90a")
        assert f"Compiling entry function '{spec.name}'" in build.log
        assert not build.spill_bytes and not build.warnings, (spec.name, build.spill_bytes, build.warnings)
        assert "wgmma.mma_async instructions are serialized" not in build.log


def test_the_producer_loaded_rows_are_a_switch_and_compile_cleanly(monkeypatch):
    """Fa3BwdSpec.rows_by_producer (a step's -LSE log2 e and D copied by the producer with its Q
    and dO, one copy for both consumers): on by default (measured: _dispatch's comment), in the
    dispatcher (score functions too) and warmup as _dispatch.FA3_BWD_ROWS_BY_PRODUCER
    says; one copy of the rows' ring (2 stages x 2 rows x block_m floats) less shared memory; it
    builds for sm_90a with no spill, no serialised wgmma and no warning (the 80-row steps, causal
    over packed sequences, the fixed order, decoupled consumers at d = 64), its consumers loading
    nothing from the per-row temporaries (their only global loads of them gone: the producer's
    bulk copies, two a step, read them)."""
    from cupyflash import _kernels
    from cupyflash._specs import Fa3BwdSpec

    flags = _dispatch.MaskFlags(False, False, False)
    assert _dispatch.FA3_BWD_ROWS_BY_PRODUCER
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS_BY_PRODUCER", False)
    assert not _dispatch.fa3_bwd_spec("bfloat16", 128, flags, False, False).rows_by_producer
    assert not any(s.rows_by_producer for s in _dispatch.all_fa3_bwd_specs())
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS_BY_PRODUCER", True)
    picked = _dispatch.fa3_bwd_spec("bfloat16", 128, flags, False, False)
    assert picked.rows_by_producer and picked.rows80 == _dispatch.FA3_BWD_ROWS80
    mods = _dispatch.MaskFlags(False, False, False, mask="mods")
    with_mods = _dispatch.fa3_bwd_spec("bfloat16", 128, mods, False, False, "/* a score_mod's code */")
    assert with_mods is not None and with_mods.rows_by_producer
    assert all(s.rows_by_producer for s in _dispatch.all_fa3_bwd_specs())
    for spec in (Fa3BwdSpec("bfloat16", 128, dq_first=True, rows80=True, rows_by_producer=True),
                 Fa3BwdSpec("float16", 64, causal=True, varlen=True, rows_by_producer=True),
                 Fa3BwdSpec("bfloat16", 128, causal=True, deterministic=True, dq_first=True, rows_by_producer=True),
                 Fa3BwdSpec("bfloat16", 64, decoupled=True, rows_by_producer=True)):  # fmt: skip
        consumer_copies = replace(spec, rows_by_producer=False)
        assert spec.smem_bytes == consumer_copies.smem_bytes - 2 * 2 * 4 * spec.block_m
        assert spec.name != consumer_copies.name
        build = _kernels.compile_offline(spec, "sm_90a")
        assert f"Compiling entry function '{spec.name}'" in build.log
        assert not build.spill_bytes and not build.warnings, (spec.name, build.spill_bytes, build.warnings)
        assert "wgmma.mma_async instructions are serialized" not in build.log
        assert build.ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 2
        before = _kernels.compile_offline(consumer_copies, "sm_90a")
        assert "cp.async.bulk.shared::cluster.global" not in before.ptx
        assert build.ptx.count("ld.global") < before.ptx.count("ld.global"), spec.name
    # the decoupled consumers' 80-row steps: only beside the producer's rows (one copy of them
    # makes room for the second dS buffer), within an H100 block; built with no warning (ptxas
    # keeps 8 bytes of two loop-invariant values in local memory there: docs/hopper.md)
    with pytest.raises(ValueError, match="rows_by_producer"):
        Fa3BwdSpec("bfloat16", 128, dq_first=True, rows80=True, decoupled=True)
    decoupled80 = Fa3BwdSpec("bfloat16", 128, dq_first=True, rows80=True, decoupled=True, rows_by_producer=True)
    assert decoupled80.smem_bytes <= H100_SMEM < decoupled80.smem_bytes + 2 * 2 * 4 * 80  # (a second copy)
    build = _kernels.compile_offline(decoupled80, "sm_90a")
    assert not build.warnings and "wgmma.mma_async instructions are serialized" not in build.log
    monkeypatch.setattr(_dispatch, "FA3_BWD_DECOUPLED", True)
    assert _dispatch.fa3_bwd_spec("bfloat16", 128, flags, False, False) == decoupled80
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS_BY_PRODUCER", False)
    assert not _dispatch.fa3_bwd_spec("bfloat16", 128, flags, False, False).rows80


@pytest.mark.parametrize("head_dim", (64, 128))
def test_the_backward_exponentials_under_dp_are_a_switch_and_compile_cleanly(monkeypatch, head_dim):
    """Fa3BwdSpec.late_exp (the exponentials after dP^T, the order before) and dq_first follow
    _dispatch.FA3_BWD_LATE_EXP and FA3_BWD_DQ_FIRST in the dispatcher and warmup. The new order
    builds for sm_90a with no spill, no serialised wgmma and no warning (causal over packed
    sequences, deterministic, dq_first), and its PTX forms a step's every exponential between the
    wait for S^T and the wait for dP^T."""
    from cupyflash import _kernels
    from cupyflash._specs import Fa3BwdSpec

    flags = _dispatch.MaskFlags(True, False, False)
    picked = _dispatch.fa3_bwd_spec("bfloat16", head_dim, flags, False, False)
    assert picked.late_exp == _dispatch.FA3_BWD_LATE_EXP
    assert {s.late_exp for s in _dispatch.all_fa3_bwd_specs()} == {_dispatch.FA3_BWD_LATE_EXP}
    under_dp = [s for s in _dispatch.all_fa3_bwd_specs() if s.head_dim == 128 and not s.softcap]
    assert {s.dq_first for s in under_dp} == {_dispatch.FA3_BWD_DQ_FIRST and not _dispatch.FA3_BWD_LATE_EXP}
    assert not any(s.dq_first for s in _dispatch.all_fa3_bwd_specs() if s.softcap or s.head_dim != 128)
    monkeypatch.setattr(_dispatch, "FA3_BWD_LATE_EXP", False)
    monkeypatch.setattr(_dispatch, "FA3_BWD_DQ_FIRST", True)
    picked = _dispatch.fa3_bwd_spec("bfloat16", head_dim, flags, False, False)
    assert not picked.late_exp and picked.dq_first == (head_dim == 128)
    # a thread's exponentials before the wait for dP^T: 64 keys x 64 query rows / 128 threads (at
    # d = 64 the first of two parts of 64 rows)
    first_part = 64 * 64 // 128
    for spec in (Fa3BwdSpec("bfloat16", head_dim, causal=True, varlen=True),
                 Fa3BwdSpec("float16", head_dim, deterministic=True),
                 Fa3BwdSpec("bfloat16", head_dim, dq_first=head_dim == 128)):  # fmt: skip
        build = _kernels.compile_offline(spec, "sm_90a")
        assert not build.spill_bytes and not build.warnings, (spec.name, build.spill_bytes, build.warnings)
        assert "wgmma.mma_async instructions are serialized" not in build.log
        lines = build.ptx.splitlines()
        waits = [i for i, line in enumerate(lines) if "wgmma.wait_group.sync.aligned" in line]
        first = next(i for i in waits if "wgmma.wait_group.sync.aligned 1" in lines[i])
        under_dp = sum("ex2.approx" in line for line in lines[first : next(i for i in waits if i > first)])
        assert under_dp == first_part, (spec.name, under_dp)


def test_the_80_row_backward_is_a_switch_plans_its_tiles_and_compiles_cleanly(monkeypatch):
    """_dispatch.FA3_BWD_ROWS80 (on): the d = 128 Hopper backward of a padded batch without a mask,
    window, score variant or fixed order takes 80-row steps (Fa3BwdSpec.rows80), and no other
    call does; its plan pads each (batch, head)'s rows to whole steps, reads Q and dO in 80-row
    boxes and marks dQacc's tiles swapped (BwdParams::dq_tiled 3, kernels_cu/dq_tiles.cuh), and
    the variant fits an H100 block and builds for sm_90a with no spill, no serialised wgmma and
    no warning, its S^T, dP^T and dQ^T m64n80 wgmmas (dQ^T's A transposed) and dS stored by
    transposing stmatrix."""
    from cupyflash import _kernels
    from cupyflash._specs import Fa3BwdSpec

    plain = _dispatch.MaskFlags(False, False, False)
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS80", False)
    assert not _dispatch.fa3_bwd_spec("bfloat16", 128, plain, False, False).rows80
    assert not any(s.rows80 for s in _dispatch.all_fa3_bwd_specs())
    monkeypatch.setattr(_dispatch, "FA3_BWD_ROWS80", True)
    _plan.clear_caches()
    spec = _dispatch.fa3_bwd_spec("bfloat16", 128, plain, False, False)
    assert spec.rows80 and spec.dq_first and spec.block_m == 80 and spec.smem_bytes <= H100_SMEM
    others = [
        ("bfloat16", 64, plain, False, False),
        ("bfloat16", 128, _dispatch.MaskFlags(True, False, False), False, False),
        ("bfloat16", 128, _dispatch.MaskFlags(False, True, False), False, False),
        ("bfloat16", 128, _dispatch.MaskFlags(False, False, True), False, False),
        ("bfloat16", 128, _dispatch.MaskFlags(False, False, False, alibi=True), False, False),
        ("bfloat16", 128, plain, True, False),  # deterministic
        ("bfloat16", 128, plain, False, True),  # packed
    ]
    assert not any(_dispatch.fa3_bwd_spec(*args).rows80 for args in others)
    assert {(s.dtype, s.head_dim) for s in _dispatch.all_fa3_bwd_specs() if s.rows80} == {
        ("bfloat16", 128), ("float16", 128)
    }  # fmt: skip
    with pytest.raises(ValueError, match="80-row steps"):
        Fa3BwdSpec("bfloat16", 128, causal=True, dq_first=True, rows80=True)
    with pytest.raises(ValueError, match="80-row steps"):
        Fa3BwdSpec("bfloat16", 128, rows80=True)  # (dK after dQ)

    shapes = ((2, 170, 4, 128), (2, 300, 2, 128), (2, 300, 2, 128))
    p = attention_problem(*shapes, causal=False, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")
    launch = _plan.plan_backward(p, "bfloat16", fake_device("sm_90a"), q_shape=shapes[0], k_shape=shapes[1])
    main = next(step for step in launch.steps if "fa3_bwd" in step.spec.name)
    assert main.spec.rows80
    assert launch.params.value("dq_tiled") == 3 and launch.params.value("row_head_stride") == 240
    assert {box for name, _, box in main.tma.maps if name in ("q", "dout")} == {80}
    _plan.clear_caches()

    for spec in (Fa3BwdSpec("bfloat16", 128, dq_first=True, rows80=True),
                 Fa3BwdSpec("float16", 128, dq_first=True, rows80=True)):  # fmt: skip
        build = _kernels.compile_offline(spec, "sm_90a")
        assert not build.spill_bytes and not build.warnings, (spec.name, build.spill_bytes, build.warnings)
        assert "wgmma.mma_async instructions are serialized" not in build.log
        # per step: S^T and dP^T 8 k-steps each, dQ^T 8 (A transposed: immediates 1, 1, 1, 0)
        assert build.ptx.count("m64n80k16") == 24, spec.name
        assert sum("m64n80k16" in line and "p, 1, 1, 1, 0;" in line for line in build.ptx.splitlines()) == 8
        assert build.ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 5  # the 5 k-steps of dS


def test_the_causal_backward_takes_its_ctas_longest_first_in_sections_when_lpt_is_on(monkeypatch):
    """_dispatch.FA3_BWD_LPT: the causal Hopper backward's BwdParams.lpt_pairs
    (tile_scheduler.cuh's fa3_bwd_tile: sections of (batch, KV head) pairs, each key block
    first) is the most pairs whose rows fit FA3_BWD_LPT_L2_BYTES, evened out over the sections
    (7 pairs, room for 4: sections of 4 and 3; 6 pairs: 3 and 3, not 4 and 2); 0, the launch
    order, when off, without causal, in the deterministic order (key blocks last to first) and
    for one pair."""

    def lpt_pairs(batch, causal=True, deterministic=False, hkv=1):
        shapes = ((batch, 700, 2 * hkv, 128), (batch, 700, hkv, 128), (batch, 700, hkv, 128))
        p = attention_problem(*shapes, causal=causal, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")
        launch = _plan.plan_backward(p, "bfloat16", fake_device("sm_90a"), q_shape=shapes[0], k_shape=shapes[1],
                                     deterministic=deterministic)  # fmt: skip
        assert any("fa3_bwd" in step.spec.name for step in launch.steps)
        return launch.params.value("lpt_pairs")

    per_pair = 700 * 2 * (128 * 8 + 8)  # Q, dO, dQacc, -LSE and D of a pair's 2 query heads
    monkeypatch.setattr(_dispatch, "FA3_BWD_LPT_L2_BYTES", 4 * per_pair)
    assert lpt_pairs(7) == 0  # off
    monkeypatch.setattr(_dispatch, "FA3_BWD_LPT", True)
    _plan.clear_caches()
    assert lpt_pairs(7) == 4 and lpt_pairs(6) == 3 and lpt_pairs(3, hkv=2) == 3 and lpt_pairs(4) == 4
    assert lpt_pairs(7, causal=False) == lpt_pairs(7, deterministic=True) == lpt_pairs(1) == 0
    monkeypatch.setattr(_dispatch, "FA3_BWD_LPT_L2_BYTES", per_pair // 2)  # not even one: one a section
    _plan.clear_caches()
    assert lpt_pairs(7) == 1
    _plan.clear_caches()


def test_the_causal_forward_takes_its_tiles_longest_first_in_sections_when_lpt_is_on(monkeypatch):
    """_dispatch.FA3_FWD_LPT: the causal Hopper forward's Fa3Params.lpt_pairs (tile_scheduler.cuh's
    TileScheduler: sections of (batch, head) pairs, each query block first) is the most pairs
    whose share of K and V fits FA3_FWD_LPT_L2_BYTES, evened out over the sections (7 pairs, room
    for 4: 4 and 3); 0 when off, without causal, and for one pair."""

    def lpt_pairs(batch, causal=True, heads=1):
        shapes = ((batch, 700, heads, 128), (batch, 700, 1, 128), (batch, 700, 1, 128))
        p = attention_problem(*shapes, causal=causal, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")
        launch = _plan.plan_attention(p, "bfloat16", fake_device("sm_90a"), "fa3", shapes[0])
        assert any("fa3_fwd" in step.spec.name for step in launch.steps)
        return launch.params.value("lpt_pairs")

    per_pair = 700 * 128 * 2 * 2  # K and V of its KV head (one query head a KV head)
    monkeypatch.setattr(_dispatch, "FA3_FWD_LPT_L2_BYTES", 4 * per_pair)
    assert lpt_pairs(7) == 0  # off
    monkeypatch.setattr(_dispatch, "FA3_FWD_LPT", True)
    _plan.clear_caches()
    assert lpt_pairs(7) == 4 and lpt_pairs(6) == 3 and lpt_pairs(1, heads=8) == 8  # GQA 8: a KV head's share
    assert lpt_pairs(7, causal=False) == lpt_pairs(1) == 0
    _plan.clear_caches()


def test_single_tile_gives_uniform_tiles_a_cta_each_when_on(monkeypatch):
    """_dispatch.FA3_FWD_SINGLE_TILE: the Hopper forward without a causal or window bound on a
    grid of every tile (Fa3Tile.single_tile, not persistent) instead of one CTA per SM; causal,
    windowed and dynamic tiles keep their schedule; a tile cannot be both; off by default."""

    def grid(causal=False, window=(-1, -1), seqlen=4000):
        shapes = ((2, seqlen, 16, 128), (2, seqlen, 4, 128), (2, seqlen, 4, 128))
        p = attention_problem(*shapes, causal=causal, scale=None, window=window, softcap=0.0, layout="bshd")
        launch = _plan.plan_attention(p, "bfloat16", fake_device("sm_90a"), "fa3", shapes[0])
        (step,) = [step for step in launch.steps if "fa3_fwd" in step.spec.name]
        return step.spec, step.grid

    tiles = 2 * 16 * -(-4000 // 128)
    spec, before = grid()
    assert not spec.tile.single_tile and spec.persistent and before[0] < tiles
    monkeypatch.setattr(_dispatch, "FA3_FWD_SINGLE_TILE", True)
    _plan.clear_caches()
    spec, after = grid()
    assert spec.tile.single_tile and not spec.persistent and after == (tiles, 1, 1)
    causal, _ = grid(causal=True)
    windowed, _ = grid(window=(100, 0))
    assert not causal.tile.single_tile and causal.persistent and causal.tile.dynamic
    assert not windowed.tile.single_tile
    with pytest.raises(ValueError, match="dynamic"):
        replace(causal.tile, single_tile=True)
    _plan.clear_caches()


def test_the_forward_consumer_index_is_a_uniform_switch_that_compiles_cleanly(monkeypatch):
    """_dispatch.FA3_FWD_UNIFORM_CONSUMER: the dispatcher's and warmup's forward variants take
    Fa3FwdSpec.uniform_consumer (named "_uc"); on, a causal packed and a windowed softcap ALiBi
    variant build for sm_90a with no spill, no serialised wgmma and no warning."""
    from cupyflash import _kernels

    flags = _dispatch.MaskFlags(True, False, False)
    assert not _dispatch.fa3_fwd_spec("bfloat16", 128, flags, 4096).uniform_consumer
    monkeypatch.setattr(_dispatch, "FA3_FWD_UNIFORM_CONSUMER", True)
    on = _dispatch.fa3_fwd_spec("bfloat16", 128, flags, 4096, varlen=True)
    assert on.uniform_consumer and on.name.endswith("_uc")
    assert all(s.uniform_consumer for s in _dispatch.all_fa3_fwd_specs())
    other = _dispatch.fa3_fwd_spec("float16", 96, _dispatch.MaskFlags(False, True, True, alibi=True), 300)
    for spec in (on, other):
        build = _kernels.compile_offline(spec, "sm_90a")
        assert not build.spill_bytes and not build.warnings, (spec.name, build.spill_bytes, build.warnings)
        assert "wgmma.mma_async instructions are serialized" not in build.log


class _Recorder:
    """Stands in for cuTensorMapEncodeTiled: records its arguments, writes a recognisable map."""

    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.calls: list[dict[str, object]] = []

    def __call__(self, address, dtype, rank, ptr, dims, strides, box, elem_strides, *modes):
        self.calls.append(
            {"dtype": dtype, "rank": rank, "ptr": ptr, "dims": list(dims[:4]), "strides": list(strides[:3]),
             "box": list(box[:4]), "modes": modes}
        )  # fmt: skip
        ctypes.memmove(address, bytes(range(128)), 128)
        return self.result


def test_tile_map_arguments_and_cache(monkeypatch):
    encode = _Recorder()
    monkeypatch.setattr(_tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(_tma, "_cache", {})
    # bshd q (B=2, N=300, H=8, d=128): element strides rows 1024, heads 128, batch 307200
    tile = _tma.tile_map("bfloat16", 0x1000, (128, 300, 8, 2), (1024, 128, 307200), 128)
    assert tile == bytes(range(128))
    call = encode.calls[0]
    assert call["dtype"] == 9 and call["rank"] == 4 and call["ptr"] == 0x1000  # BFLOAT16
    assert call["dims"] == [128, 300, 8, 2]
    assert call["strides"] == [2048, 256, 614400]  # bytes
    assert call["box"] == [64, 128, 1, 1]  # one 128-byte swizzle row x the tile's rows
    assert call["modes"] == (0, 3, 3, 0)  # no interleave, 128-byte swizzle, L2 256B, zero fill
    # the same buffer again: served from the cache, no driver call
    assert _tma.tile_map("bfloat16", 0x1000, (128, 300, 8, 2), (1024, 128, 307200), 128) == tile
    assert len(encode.calls) == 1
    # size-1 axes (their strides are never used) and an empty key axis still give a legal map
    _tma.tile_map("float16", 0x2000, (64, 0, 1, 1), (64, 3, 5), 128)
    call = encode.calls[1]
    assert call["dtype"] == 6 and call["dims"] == [64, 1, 1, 1] and call["strides"] == [16, 16, 16]


def test_tile_map_failure_names_the_map(monkeypatch):
    monkeypatch.setattr(_tma, "_encode_fn", lambda: _Recorder(result=1))
    monkeypatch.setattr(_tma, "_cache", {})
    with pytest.raises(_tma.TmaEncodeError, match=r"CUresult 1.*dims \[64, 10, 2, 1\]"):
        _tma.tile_map("float16", 0x3000, (64, 10, 2, 1), (128, 64, 1280), 64)
