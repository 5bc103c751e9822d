"""The GPU branch of every entry point up to its launch, on a machine without a GPU: stand-ins
that cupyflash takes for CuPy arrays on GPU 0, an H100's ``DeviceInfo``, and ``_launch`` stubbed
to record what it is handed. Each call must plan (the real planners, nothing compiled) and hand
the launch every operand its plan reads, by name; the kernels themselves are the GPU tests'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cupyflash
from cupyflash import _device, _interop, _launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from host_overhead import H100, stand_in  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def launches(monkeypatch):
    """The launches the calls hand to ``_launch``: (launch, operand names given) each."""
    seen: list[tuple[object, set[str]]] = []

    def run(launch, lib, device, arrays, want_lse, given=_launch.EMPTY):
        seen.append((launch, {n for n, x in arrays.items() if x is not None}))
        return "out", ("lse" if want_lse else None)

    def run_outputs(launch, lib, device, arrays, given=_launch.EMPTY):
        seen.append((launch, {n for n, x in arrays.items() if x is not None}))
        return tuple(stand_in(o.shape, o.dtype) for o in launch.outputs)

    info = _device.DeviceInfo(index=0, **H100)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    monkeypatch.setattr(_launch, "run", run)
    monkeypatch.setattr(_launch, "run_outputs", run_outputs)
    monkeypatch.setattr(_interop, "current_device", lambda: 0)
    monkeypatch.setattr(_interop, "stream_is_capturing", lambda stream: False)
    monkeypatch.setattr(_interop.CupyLib, "stream", lambda self, device: 0)
    # a host summary's copy to the GPU (a mask_mod's implied one): a stand-in
    monkeypatch.setattr(_interop, "upload", lambda x, device: stand_in(x.shape, str(x.dtype)))
    return seen


def _check(seen: list[tuple[object, set[str]]], kernels: str, optional: tuple[str, ...] = ()) -> None:
    """Every launch got the operands its plan reads but the ``optional`` ones the call left out
    (a seed is a launch parameter, not an operand), and the last one runs a kernel named like
    ``kernels``."""
    assert seen
    for launch, given in seen:
        wanted = {op.name for op in launch.operands} - set(optional)
        assert wanted <= given, f"operands the plan reads but the call did not hand over: {wanted - given}"
    names = [step.spec.name for step in seen[-1][0].steps if hasattr(step, "spec")]
    assert any(kernels in name for name in names), names


def test_attention_routes_to_the_hopper_kernel(launches):
    q = stand_in((2, 300, 8, 128), "float16")
    kv = stand_in((2, 333, 2, 128), "float16")
    assert cupyflash.attention(q, kv, kv, causal=True) == "out"
    assert cupyflash.attention(q, kv, kv, return_lse=True) == ("out", "lse")
    _check(launches, "fa3_fwd")


def test_attention_options_route_to_fa2(launches):
    q = stand_in((2, 300, 8, 64), "bfloat16")
    kv = stand_in((2, 333, 2, 64), "bfloat16")
    slopes = stand_in((8,), "float32")
    cupyflash.attention(q, kv, kv, alibi_slopes=slopes, dropout_p=0.1, seed=3)
    _check(launches, "fa2_fwd")
    mask = stand_in((2, 1, 300, 333), "bool")
    cupyflash.attention(q, kv, kv, attn_mask=mask)
    _check(launches, "mask")


def test_alibi_routes_to_the_hopper_kernels(launches):
    """ALiBi alone runs on the Hopper forward and backward (and the forward of packed sequences);
    with softcap the backward stays on the mma.sync kernel (its derivative needs the capped score)."""
    q = stand_in((2, 300, 8, 64), "bfloat16")
    kv = stand_in((2, 333, 2, 64), "bfloat16")
    lse = stand_in((2, 8, 300), "float32")
    slopes = stand_in((2, 8), "float32")
    cupyflash.attention(q, kv, kv, alibi_slopes=slopes, causal=True)
    _check(launches, "fa3_fwd")
    assert "_alibi" in launches[-1][0].steps[-1].spec.name
    cupyflash.attention_backward(q, q, kv, kv, q, lse, alibi_slopes=slopes, causal=True)
    _check(launches, "fa3_bwd", optional=("dlse",))
    assert any("fa3_bwd" in s.spec.name and "_alibi" in s.spec.name for s in launches[-1][0].steps)
    cupyflash.attention_backward(q, q, kv, kv, q, lse, alibi_slopes=slopes, softcap=5.0)
    _check(launches, "fa2_bwd", optional=("dlse",))
    launches.clear()
    packed = stand_in((1000, 8, 128), "bfloat16")
    cu = stand_in((3,), "int32")
    cupyflash.attention_varlen(packed, packed, packed, cu, cu, 600, 600, alibi_slopes=slopes)
    _check(launches, "fa3_fwd")
    assert "_alibi_varlen" in launches[-1][0].steps[-1].spec.name


def test_decode_and_cache_calls(launches):
    q = stand_in((8, 1, 32, 128), "float16")
    cache = stand_in((8, 4096, 8, 128), "float16")
    cupyflash.attention(q, cache, cache)
    _check(launches, "decode")
    new = stand_in((8, 1, 8, 128), "float16")
    seqlens = stand_in((8,), "int32")
    cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=seqlens, k_new=new, v_new=new, causal=True)
    cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, return_lse=True)
    _check(launches, "decode")


def test_varlen_plain_and_paged(launches):
    packed = stand_in((1000, 8, 128), "bfloat16")
    cu = stand_in((3,), "int32")
    cupyflash.attention_varlen(packed, packed, packed, cu, cu, 600, 600, causal=True)
    _check(launches, "fwd")
    pages = stand_in((64, 16, 8, 128), "bfloat16")
    table = stand_in((2, 32), "int32")
    cupyflash.attention_varlen(packed, pages, pages, cu, cu, 600, 512, block_table=table)
    _check(launches, "fa2")


def test_varlen_plans_found_by_checked_maxima_only(launches):
    """A packed call's plan is looked up by its arguments as given, its Problem checked once per
    plan: a max_seqlen that only compares equal to an int (a bool, a float) must be refused, not
    served the int's plan, and one past the packed length refused whatever was planned before."""
    packed = stand_in((1000, 8, 128), "bfloat16")
    cu = stand_in((3,), "int32")
    pages = stand_in((64, 16, 8, 128), "bfloat16")
    table = stand_in((2, 32), "int32")
    for k, extra in ((packed, {}), (pages, {"block_table": table})):
        for max_q in (1, 600):
            cupyflash.attention_varlen(packed, k, k, cu, cu, max_q, 512, **extra)
        for bad in (True, 600.0):
            with pytest.raises(ValueError, match="max_seqlen_q must be an int"):
                cupyflash.attention_varlen(packed, k, k, cu, cu, bad, 512, **extra)
        with pytest.raises(ValueError, match="exceed"):
            cupyflash.attention_varlen(packed, k, k, cu, cu, 1001, 512, **extra)


def test_backward_calls(launches):
    q = stand_in((2, 300, 8, 64), "bfloat16")
    kv = stand_in((2, 333, 2, 64), "bfloat16")
    lse = stand_in((2, 8, 300), "float32")
    dq, dk, dv = cupyflash.attention_backward(q, q, kv, kv, q, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == kv.shape
    _check(launches, "bwd", optional=("dlse",))
    packed = stand_in((1000, 8, 64), "bfloat16")
    cu = stand_in((3,), "int32")
    plse = stand_in((8, 1000), "float32")
    cupyflash.attention_varlen_backward(packed, packed, packed, packed, packed, plse, cu, cu, 600, 600)
    _check(launches, "bwd", optional=("dlse",))


def test_fp8_forward(launches):
    q = stand_in((1, 512, 8, 128), "uint8")
    descale = stand_in((1, 8), "float32")
    cupyflash.attention(q, q, q, fp8_dtype="e4m3", q_descale=descale, k_descale=0.5, causal=True)
    _check(launches, "fa3_fwd", optional=("v_descale",))  # None: 1.0
    assert any("fp8_vt" in step.spec.name for launch, _ in launches for step in launch.steps)


def test_score_and_mask_functions_route_to_the_fa2_hook(launches, monkeypatch):
    """score_mod / mask_mod on GPU arrays: the FA2 kernel with the functions compiled in (mask
    kind "mods"), the softmax multiplier log2 e, the function's scale the caller's (negative:
    |scale| on -q), each captured array an operand in slot order; the same functions again plan
    nothing new; the backward on the Hopper kernel with the hook; an
    array on the host is refused, named."""
    import math

    from cupyflash import _plan

    q = stand_in((2, 300, 8, 64), "bfloat16")
    kv = stand_in((2, 333, 2, 64), "bfloat16")
    bias, doc = stand_in((8, 333), "float32"), stand_in((333,), "int32")

    def score_mod(s, b, h, i, j):
        return s + bias[h, j]

    def mask_mod(b, h, i, j):
        return doc[i] == doc[j]

    for _ in range(2):
        cupyflash.attention(q, kv, kv, scale=-0.3, score_mod=score_mod, mask_mod=mask_mod)
    _check(launches, "fa3_fwd")  # on Hopper: the wgmma kernel, the functions in its score step
    (launch, given), again = launches[0], launches[1][0]
    assert again is launch  # planned once
    (step,) = launch.steps
    assert "cf_user_mods" in step.spec.mods_source and step.spec.tile.consumers == 2
    cupyflash.attention(q, kv, kv, scale=-0.3, score_mod=score_mod, mask_mod=mask_mod, algorithm="fa2")
    _check(launches, "fa2_fwd")
    assert launches[-1][0].steps[0].spec.mask == "mods"
    assert {"mod_buffer0", "mod_buffer1"} <= given
    values = launch.params
    assert values.value("softmax_scale_log2") == pytest.approx(_plan.common.LOG2E)
    assert values.value("mod_score_scale") == pytest.approx(0.3, rel=1e-6)
    assert [op.name for op in launch.operands if op.name.startswith("mod_")] == ["mod_buffer0", "mod_buffer1"]
    assert next(op for op in launch.operands if op.name == "q").negate
    strides = {op.name: len(op.stride_slots) for op in launch.operands}
    assert strides["mod_buffer0"] == 2 and strides["mod_buffer1"] == 1
    assert not math.isnan(values.value("mod_score_scale"))
    lse = stand_in((2, 8, 300), "float32")
    cupyflash.attention_backward(q, q, kv, kv, q, lse, scale=-0.3, score_mod=score_mod, mask_mod=mask_mod)
    _check(launches, "fa3_bwd", optional=("dlse",))  # d = 64: the Hopper backward's hook
    names = [step.spec.name for step in launches[-1][0].steps]
    assert any("fa3_bwd" in n and "mods" in n for n in names)
    launches.clear()
    square = stand_in((2, 333, 2, 64), "bfloat16")
    cupyflash.attention(square, square, square, mask_mod=lambda b, h, i, j: (j <= i) & (i - j < 100))
    (step,) = launches[-1][0].steps
    assert step.spec.causal and step.spec.local  # the bounds the mask implies: tiles skipped
    launches.clear()
    import numpy as np

    on_host = np.zeros(333, np.int32)
    with pytest.raises(ValueError, match="mask_mod's captured array 0 is a numpy array on the host"):
        cupyflash.attention(q, kv, kv, mask_mod=lambda b, h, i, j: on_host[j] == 0)
    with pytest.raises(ValueError, match="do not combine with softcap"):
        cupyflash.attention(q, kv, kv, softcap=5.0, mask_mod=mask_mod)
    with pytest.raises(ValueError, match="run on the FA2 or the Hopper kernel"):
        cupyflash.attention(q, kv, kv, algorithm="fa1", mask_mod=mask_mod)
    wide = stand_in((2, 333, 2, 256), "bfloat16")  # above d = 128: FA2's tiles take the functions
    cupyflash.attention(stand_in((2, 300, 8, 256), "bfloat16"), wide, wide, mask_mod=mask_mod)
    _check(launches, "fa2_fwd")


def test_varlen_score_and_mask_functions(launches):
    """attention_varlen with score_mod / mask_mod on GPU arrays: the Hopper forward's packed
    variant with the hook (FA2's with algorithm="fa2"), the offsets and each captured array an
    operand, every read checked (no index ranges: the lengths stay on the device), planned once;
    the backward on the packed Hopper backward with the hook (d = 64), the mma.sync one at d = 80."""
    packed = stand_in((1000, 8, 64), "bfloat16")
    cu = stand_in((3,), "int32")
    table, prefix = stand_in((2, 8), "float32"), stand_in((2,), "int32")

    def score_mod(s, b, h, i, j):
        return s + table[b, h]

    def mask_mod(b, h, i, j):
        return (j <= i) | (j < prefix[b])

    for _ in range(2):
        cupyflash.attention_varlen(packed, packed, packed, cu, cu, 600, 600, score_mod=score_mod, mask_mod=mask_mod)
    _check(launches, "fa3_fwd")
    (launch, given), again = launches[0], launches[1][0]
    assert again is launch
    fill, step = launch.steps  # (the rows no sequence owns first: packed_fill.cu)
    assert fill.spec.kernel == "packed_fill" and fill.spec.params_type == "Fa3Params"
    assert step.spec.varlen and "cf_user_mods" in step.spec.mods_source
    assert "st.outside |= !in" in step.spec.mods_source  # every read checked
    assert {"cu_seqlens_q", "cu_seqlens_k", "mod_buffer0", "mod_buffer1"} <= given
    cupyflash.attention_varlen(
        packed, packed, packed, cu, cu, 600, 600, score_mod=score_mod, mask_mod=mask_mod, algorithm="fa2"
    )
    _check(launches, "fa2_fwd")
    assert launches[-1][0].steps[-1].spec.mask == "mods"
    assert launches[-1][0].steps[0].spec.params_type == "AttnParams"  # (the packed fill, in FA2's params)
    plse = stand_in((8, 1000), "float32")
    cupyflash.attention_varlen_backward(
        packed, packed, packed, packed, packed, plse, cu, cu, 600, 600, score_mod=score_mod, mask_mod=mask_mod
    )
    _check(launches, "fa3_bwd", optional=("dlse",))
    names = [step.spec.name for step in launches[-1][0].steps]
    assert any("fa3_bwd" in n and "mods" in n and "varlen" in n for n in names)
    odd = stand_in((1000, 8, 80), "bfloat16")
    cupyflash.attention_varlen_backward(
        odd, odd, odd, odd, odd, plse, cu, cu, 600, 600, score_mod=score_mod, mask_mod=mask_mod
    )
    _check(launches, "fa2_bwd", optional=("dlse",))
    names = [step.spec.name for step in launches[-1][0].steps]
    assert not any("fa3_bwd" in n for n in names) and any("mods" in n for n in names)
    with pytest.raises(ValueError, match="do not combine with softcap"):
        cupyflash.attention_varlen(packed, packed, packed, cu, cu, 600, 600, softcap=5.0, mask_mod=mask_mod)


def test_packed_sequences_whose_rows_and_keys_align_take_a_mask_s_bounds(launches):
    """One offsets array for queries and keys (and equal maxima): each sequence's rows and keys
    align, so a mask_mod that is a causal bound runs as the built-in packed kernels (no hook,
    forward and backward), and one that implies a bound beside more (a prefix, a chunk) gets
    the causal variant's tile bounds with the hook; two offsets arrays (even equal ones) or
    seqused_k keep the hook alone over every tile."""
    packed = stand_in((1000, 8, 64), "bfloat16")
    cu, other = stand_in((3,), "int32"), stand_in((3,), "int32")
    plse = stand_in((8, 1000), "float32")

    def causal(b, h, i, j):
        return j <= i

    def causal_chunks(b, h, i, j):
        return (j <= i) & (i // 64 == j // 64)

    cupyflash.attention_varlen(packed, packed, packed, cu, cu, 600, 600, mask_mod=causal)
    step = launches[-1][0].steps[-1]
    assert step.spec.causal and not step.spec.mods_source
    cupyflash.attention_varlen_backward(packed, packed, packed, packed, packed, plse, cu, cu, 600, 600, mask_mod=causal)
    names = [step.spec.name for step in launches[-1][0].steps]
    assert any("fa3_bwd" in n and "causal" in n and "mods" not in n for n in names), names
    cupyflash.attention_varlen(packed, packed, packed, cu, cu, 600, 600, mask_mod=causal_chunks)
    step = launches[-1][0].steps[-1]
    assert step.spec.causal and step.spec.mods_source
    cupyflash.attention_varlen_backward(
        packed, packed, packed, packed, packed, plse, cu, cu, 600, 600, mask_mod=causal_chunks
    )
    names = [step.spec.name for step in launches[-1][0].steps]
    assert any("fa3_bwd" in n and "causal" in n and "mods" in n for n in names), names
    for args, extra in (((cu, other, 600, 600), {}), ((cu, cu, 600, 599), {}),
                        ((cu, cu, 600, 600), {"seqused_k": stand_in((2,), "int32")})):  # fmt: skip
        cupyflash.attention_varlen(packed, packed, packed, *args, mask_mod=causal, **extra)
        step = launches[-1][0].steps[-1]
        assert not step.spec.causal and step.spec.mods_source


def test_a_mask_mod_that_is_a_bound_runs_as_the_bound(launches):
    """A mask_mod that is a causal or sliding-window bound and nothing else (Nq = Nk) runs as
    that bound: the built-in kernels and params, forward and backward, with its BlockMask too; a
    mask with any other term, or over Nq != Nk, keeps its hook."""
    from cupyflash import _mods

    square = stand_in((2, 333, 2, 64), "bfloat16")
    lse = stand_in((2, 2, 333), "float32")
    window = 100

    def sliding(b, h, i, j):
        return (j <= i) & (i - j < window)

    def ran() -> tuple[list[str], dict[str, int]]:
        launch = launches[-1][0]
        names = [step.spec.name for step in launch.steps if hasattr(step, "spec")]
        bounds = {name: launch.params.value(name) for name in ("window_left", "window_right")}
        return names, bounds

    for mask, options in ((lambda b, h, i, j: j <= i, {"causal": True}), (sliding, {"window": (window - 1, 0)})):
        block = cupyflash.create_block_mask(mask, None, None, 333, 333)
        for call in (
            lambda **kw: cupyflash.attention(square, square, square, **kw),
            lambda **kw: cupyflash.attention_backward(square, square, square, square, square, lse, **kw),
        ):
            call(**options)
            want = ran()
            assert not any("mods" in name for name in want[0])
            call(mask_mod=mask)
            assert ran() == want
            call(block_mask=block)
            assert ran() == want
    cupyflash.attention(square, square, square, causal=True, softcap=5.0)  # options the hook has not: as the bound's
    want = ran()
    cupyflash.attention(square, square, square, softcap=5.0, mask_mod=lambda b, h, i, j: j <= i)
    assert ran() == want
    other = cupyflash.create_block_mask(sliding, None, None, 256, 256)
    with pytest.raises(ValueError, match="Q_LEN"):  # a BlockMask made for another call is refused all the same
        cupyflash.attention(square, square, square, block_mask=other)
    doc = stand_in((333,), "int32")
    cupyflash.attention(square, square, square, mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))
    assert all("mods" in name for name in ran()[0])
    cupyflash.attention(stand_in((2, 300, 2, 64), "bfloat16"), square, square, mask_mod=lambda b, h, i, j: j <= i)
    assert all("mods" in name for name in ran()[0])  # q_idx >= kv_idx is not bottom-right causal here
    assert _mods.exact_window(_mods.trace_mask_mod(lambda b, h, i, j: j < i)) is None  # no diagonal


def test_a_repeated_backward_skips_its_checks_but_not_a_changed_one(launches, monkeypatch):
    """A backward whose arrays' shapes, dtypes and options were planned before goes straight to
    that plan (the problem is not rebuilt: its checks were made then); one that differs in any of
    them (a dout of another shape, an lse of another dtype, another scale) is checked again."""
    from cupyflash import _attention

    built = []
    original = _attention.backward_problem
    monkeypatch.setattr(_attention, "backward_problem", lambda call: built.append(1) or original(call))
    q = stand_in((3, 211, 8, 64), "bfloat16")  # shapes no other test plans (the plans outlive a test)
    kv = stand_in((3, 233, 2, 64), "bfloat16")
    lse = stand_in((3, 8, 211), "float32")
    for _ in range(3):
        cupyflash.attention_backward(q, q, kv, kv, q, lse, causal=True)
    assert len(built) == 1 and launches[0][0] is launches[2][0]
    _check(launches, "bwd", optional=("dlse", "dropout_seed", "alibi_slopes", "attn_mask"))
    with pytest.raises(ValueError, match="dout"):
        cupyflash.attention_backward(stand_in((3, 212, 8, 64), "bfloat16"), q, kv, kv, q, lse, causal=True)
    with pytest.raises((TypeError, ValueError), match="lse"):
        cupyflash.attention_backward(q, q, kv, kv, q, stand_in((3, 8, 211), "float16"), causal=True)
    cupyflash.attention_backward(q, q, kv, kv, q, lse, causal=True, scale=0.5)
    assert len(built) == 4


def test_fp8_cache_host_scales_checked_every_call(launches):
    """A float8 cache's host scales go to the kernel per call, so each call's value is checked
    (the plan, keyed by the scale's form, is shared by every value); array scales are operands."""
    q = stand_in((8, 1, 32, 128), "float16")
    cache = stand_in((8, 4096, 8, 128), "uint8")
    scale = stand_in((8,), "float32")
    for k_scale in (0.5, 2):
        cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, kv_dtype="e4m3", k_scale=k_scale)
        _check(launches, "decode", optional=("k_scale", "v_scale"))
    cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, kv_dtype="e4m3", k_scale=scale, v_scale=0.25)
    assert "k_scale" in launches[-1][1]
    for bad in (-0.5, float("inf"), 1e39):
        with pytest.raises(ValueError, match="k_scale must be positive and finite"):
            cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, kv_dtype="e4m3", k_scale=bad)
    with pytest.raises(TypeError, match="v_scale must be a positive float"):
        cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, kv_dtype="e4m3", v_scale=True)


def test_a_block_mask_reaches_the_kernels(launches, monkeypatch):
    """A block_mask on GPU arrays: made on the host, its summary copied to the GPU at the first
    call there (the copy stubbed: stand-ins), its layout fixed in each plan (the Hopper forward,
    FA2's, the mma.sync backward) and its three buffers handed to the launch by address (the
    same copy for every later call); a call of another length is refused before anything runs."""
    from cupyflash import _block_mask

    copies = []
    monkeypatch.setattr(_interop, "upload", lambda x, device: copies.append(x) or stand_in(x.shape, str(x.dtype)))
    q = stand_in((2, 300, 8, 128), "bfloat16")
    kv = stand_in((2, 300, 2, 128), "bfloat16")
    bm = cupyflash.create_block_mask(lambda b, h, i, j: (i // 100) == (j // 100), None, 8, 300, 300, BLOCK_SIZE=64)
    pointers = _block_mask.kernel_buffers(bm, _interop.CUPY_LIB, 0)
    assert len(copies) == 3 and all(isinstance(p, int) for p in pointers)
    for algorithm, kernel in (("auto", "fa3_fwd"), ("fa2", "fa2_fwd")):
        cupyflash.attention(q, kv, kv, block_mask=bm, algorithm=algorithm)
        _check(launches, kernel)
        launch, given = launches[-1]
        assert {"mask_cells", "mask_key_ranges", "mask_row_ranges"} <= given
        values = launch.params
        assert values.value("mask_cell_rows_log2") == 6 and values.value("mask_cell_keys_log2") == 6
        assert values.value("mask_cells_batch_stride") == 0 and values.value("mask_cells_head_stride") == 0
        assert values.value("mask_cells_row_stride") == 6  # 300 keys: three 128-key blocks of two 64-key cells
        assert values.value("mask_key_ranges_head_stride") == 0  # the mask reads no h: one summary for all
    lse = stand_in((2, 8, 300), "float32")
    cupyflash.attention_backward(q, q, kv, kv, q, lse, block_mask=bm)
    _check(launches, "fa2_bwd", optional=("dlse",))
    assert {"mask_cells", "mask_key_ranges", "mask_row_ranges"} <= launches[-1][1]
    assert len(copies) == 3  # copied once
    short = stand_in((2, 299, 8, 128), "bfloat16")
    with pytest.raises(ValueError, match="Q_LEN=300"):
        cupyflash.attention(short, kv, kv, block_mask=bm)
    elsewhere = _on_gpu_1(bm)
    with pytest.raises(ValueError, match="made on GPU 1; this call runs on GPU 0"):
        _block_mask.kernel_buffers(elsewhere, _interop.CUPY_LIB, 0)


def test_a_mask_mod_alone_hands_the_kernels_the_summary_it_implies(launches, monkeypatch):
    """A mask_mod whose index arithmetic hides or shows whole cells (chunks here) and no
    block_mask: the summary its tile classes imply, made on the host once and copied to the GPU at
    the first call, handed to the Hopper forward, FA2's and the mma.sync backward; none for a mask
    whose cells all depend on its array (a document mask alone: its backward then the Hopper
    one, the mask in its hook), nor while a CUDA graph is being captured before the first copy
    (the same result: the kernels then evaluate every tile); one a capture reads is kept for the
    process."""
    from cupyflash import _block_mask

    copies = []
    monkeypatch.setattr(_interop, "upload", lambda x, device: copies.append(x) or stand_in(x.shape, str(x.dtype)))
    q = stand_in((2, 300, 8, 128), "float16")
    kv = stand_in((2, 300, 2, 128), "float16")
    lse = stand_in((2, 8, 300), "float32")
    summary = {"mask_cells", "mask_key_ranges", "mask_row_ranges"}

    def chunked(b, h, i, j):
        return (i // 128 == j // 128) & (j <= i)

    capturing = [True]
    monkeypatch.setattr(_interop, "stream_is_capturing", lambda stream: capturing[0])
    cupyflash.attention(q, kv, kv, mask_mod=chunked)
    assert not summary & launches[-1][1] and not copies
    capturing[0] = False
    for algorithm, kernel in (("auto", "fa3_fwd"), ("fa2", "fa2_fwd")):
        cupyflash.attention(q, kv, kv, mask_mod=chunked, algorithm=algorithm)
        _check(launches, kernel)
        assert summary <= launches[-1][1]
        assert launches[-1][0].params.value("mask_cell_rows_log2") == 6
    cupyflash.attention_backward(q, q, kv, kv, q, lse, mask_mod=chunked)
    _check(launches, "fa2_bwd", optional=("dlse",))
    assert summary <= launches[-1][1]
    assert len(copies) == 3  # one copy, for every call
    capturing[0] = True  # copied already: read while capturing too, and kept (the graph holds its addresses)
    cupyflash.attention(q, kv, kv, mask_mod=chunked)
    assert summary <= launches[-1][1]
    assert any(bm.shape == (2, 8, 300, 300) and bm._mod.key for bm in _block_mask._captured.values())
    doc = stand_in((300,), "int32")
    cupyflash.attention(q, kv, kv, mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    assert not summary & launches[-1][1]
    assert _block_mask.implied(_mods_trace(lambda b, h, i, j: doc[i] == doc[j]), 2, 8, 300, 300) is None
    # with no summary to skip tiles by, a mask_mod alone's backward is the Hopper one, the mask in
    # its hook (with a score_mod, or a summary, it stays on the mma.sync kernels: above)
    for deterministic in (False, True):
        cupyflash.attention_backward(q, q, kv, kv, q, lse, mask_mod=lambda b, h, i, j: doc[i] == doc[j],
                                     deterministic=deterministic)  # fmt: skip
        _check(launches, "fa3_bwd", optional=("dlse",))
        (hopper,) = [step.spec for step in launches[-1][0].steps if "fa3_bwd" in step.spec.name]
        assert "cf_user_mods" in hopper.mods_source and hopper.deterministic == deterministic
        assert "mod_buffer0" in launches[-1][1] and not summary & launches[-1][1]


def _mods_trace(mask_mod):
    from cupyflash import _mods

    return _mods.trace_mask_mod(mask_mod)


def _on_gpu_1(bm):
    """A copy of ``bm`` as if made on GPU 1 (no address known yet)."""
    clone = type(bm).__new__(type(bm))
    for name in type(bm).__slots__:
        setattr(clone, name, getattr(bm, name))
    clone._device, clone._pointers = 1, {}
    return clone


def test_the_block_mask_summary_plan():
    """The summary kernel's launch: a CTA per cell (grid keys x rows x summarised (batch, head)),
    the cells' strides and sizes, the mask's captured arrays as operands, the "cells" output."""
    import numpy as np

    from cupyflash import _mods, _plan

    doc = np.zeros(300, np.int32)
    mod = _mods.trace_mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (h > 1))
    kernel = _mods.kernel_mods(None, mod)
    launch = _plan.plan_block_mask_cells(kernel, (1, 8), (300, 500), (32, 64), (12, 8))
    (step,) = launch.steps
    assert step.grid == (8, 12, 8) and step.spec.name.startswith("cf_block_mask_cells_")
    assert [o.name for o in launch.operands] == ["mod_buffer0"]
    (cells,) = launch.outputs
    assert cells.shape == (1, 8, 12, 8) and cells.dtype == "uint8"
    v = launch.params.value
    assert (v("mask_cells_batch_stride"), v("mask_cells_head_stride"), v("mask_cells_row_stride")) == (0, 96, 8)
    assert (v("mask_cell_rows_log2"), v("mask_cell_keys_log2"), v("mask_heads")) == (5, 6, 8)
    assert (v("seqlen_q"), v("seqlen_k")) == (300, 500)


def test_a_call_site_s_recent_plans_serve_only_their_own_signatures(launches):
    """gpu_forward and gpu_with_kvcache keep the plans of the last two signatures they met
    (``PlanCache.recent``): a call that differs from them in any part of its signature (a shape,
    an option, an optional array) gets its own plan, the same one each time, also when two or
    more kinds of call alternate; a cleared cache forgets the recent plans with the others."""
    from cupyflash import _plan

    q = stand_in((2, 177, 8, 128), "float16")  # shapes no other test plans (the plans outlive a test)
    kv = stand_in((2, 199, 2, 128), "float16")
    q1 = stand_in((2, 1, 8, 128), "float16")
    sinks = stand_in((8,), "float32")
    square = stand_in((2, 24, 24, 128), "float16")
    cache = stand_in((2, 211, 2, 128), "float16")
    seqlens = stand_in((2,), "int32")
    calls = [
        lambda: cupyflash.attention(q, kv, kv),
        lambda: cupyflash.attention(q, kv, kv, causal=True),
        lambda: cupyflash.attention(q, kv, kv, window=(16, 0)),
        lambda: cupyflash.attention(q, kv, kv, sinks=sinks),
        lambda: cupyflash.attention(q1, kv, kv),
        lambda: cupyflash.attention(square, square, square),
        lambda: cupyflash.attention(square, square, square, layout="bhsd"),  # the same shapes read otherwise
        lambda: cupyflash.attention_with_kvcache(q1, cache, cache, cache_seqlens=200),
        lambda: cupyflash.attention_with_kvcache(q1, cache, cache, cache_seqlens=seqlens),
        lambda: cupyflash.attention_with_kvcache(q1, cache, cache, cache_seqlens=seqlens, causal=False),
    ]
    for _ in range(2):
        for call in calls:
            call()
            call()
    plans = [launch for launch, _ in launches]
    n = len(calls)
    for i in range(n):
        assert plans[2 * i] is plans[2 * i + 1] is plans[2 * n + 2 * i] is plans[2 * n + 2 * i + 1]
    assert len({id(plan) for plan in plans}) == n
    for first, second in ((0, 1), (1, 4), (6, 7)):  # two kinds of call alternating, each its own plan
        launches.clear()
        for _ in range(3):
            calls[first]()
            calls[second]()
        expected = [plans[2 * first], plans[2 * second]] * 3
        assert all(launch is plan for (launch, _), plan in zip(launches, expected, strict=True))
    _plan.clear_caches()
    for call in (calls[0], calls[-1]):
        call()
    assert launches[-2][0] is not plans[0] and launches[-1][0] is not plans[2 * n - 2]


def test_the_per_token_check_reads_every_array(monkeypatch):
    """``_interop.lean_arrays``, the route's per-token check: one library on one GPU, and for
    tensors whether any requires grad (grad mode on), whichever array it is; anything else is
    left to ``gpu_arrays`` (None)."""
    a, b = stand_in((2, 8), "float16"), stand_in((2, 8), "float16")
    assert _interop.lean_arrays((a, None, b)) == (_interop.CUPY_LIB, 0, False)
    other = stand_in((2, 8), "float16")
    other.data = type(a.data)(1 << 20)
    other.data.device_id = 1
    assert _interop.lean_arrays((a, b, None, other)) is None
    assert _interop.lean_arrays((other, a)) is None
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: getattr(self, "gpu", 0), raising=False)
    t, u, w = (torch.zeros(2, 8) for _ in range(3))
    assert _interop.lean_arrays((t, u, None, w)) == (_interop.TORCH_LIB, 0, False)
    assert _interop.lean_arrays((t, a)) is None and _interop.lean_arrays((a, t)) is None
    w.gpu = 1
    assert _interop.lean_arrays((t, u, None, w)) is None
    w.gpu = 0
    for grad in (t, w):
        grad.requires_grad_(True)
        assert _interop.lean_arrays((t, u, None, w)) == (_interop.TORCH_LIB, 0, True)
        with torch.no_grad():
            assert _interop.lean_arrays((t, u, None, w)) == (_interop.TORCH_LIB, 0, False)
        grad.requires_grad_(False)
