"""``_launch.run`` on the CPU, with NumPy standing in for device memory and a recorder for the
kernel: every params field a call sets is the one its plan names (pointers, strides, lengths,
outputs, scratch), operands the kernels cannot read are copied (never a cache written in place),
and the straight path of a repeated call gives the same params as the first."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from cupyflash import _device, _interop, _kernels, _launch, _plan, _workspace
from cupyflash._params import PARAMS_STRUCTS, ParamsStruct
from cupyflash._validate import attention_problem, kvcache_problem, varlen_problem

H200 = _device.HOPPER


class _NumpyLib(_interop.ArrayLib):
    """Host memory as the device: pointers are NumPy data addresses, strides in elements."""

    name = "cupy"

    def ptr(self, x):  # type: ignore[no-untyped-def]
        return x.ctypes.data

    def strides(self, x):  # type: ignore[no-untyped-def]
        return tuple(s // x.itemsize for s in x.strides)

    def raw_strides(self, x):  # type: ignore[no-untyped-def]
        return x.strides

    def dtype_name(self, x):  # type: ignore[no-untyped-def]
        return str(x.dtype)

    def empty(self, shape, dtype, device, like=None):  # type: ignore[no-untyped-def]
        return np.empty(shape, dtype="float16" if dtype == "bfloat16" else dtype)

    def fill(self, x, value):  # type: ignore[no-untyped-def]
        x.fill(value)

    def copy(self, x):  # type: ignore[no-untyped-def]
        return np.ascontiguousarray(x).copy()

    def stream(self, device):  # type: ignore[no-untyped-def]
        return 7


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def launch(self, grid, block, smem, stream, values, tma_maps=None, packed=None):  # type: ignore[no-untyped-def]
        self.calls.append((grid, block, smem, stream, tuple(values), tma_maps, packed is not None))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(_kernels, "get_kernel", lambda spec, device: rec)
    monkeypatch.setattr(_interop, "current_device", lambda: 0)
    monkeypatch.setattr(_workspace, "stream_is_capturing", lambda stream: False)
    monkeypatch.setattr(_workspace, "_buffers", {})
    monkeypatch.setattr(_workspace, "error_word_ptrs", {0: 4242})
    monkeypatch.setattr(_launch._tma, "tile_map", lambda *args: bytes(128))
    return rec


def _field(launch: _plan.Launch, values: tuple[Any, ...], name: str) -> Any:
    return values[launch.params.slot(name)]


def _arrays(rng: np.random.Generator, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(np.float16) for s in shapes]


def test_forward_fields_by_name(recorder):
    rng = np.random.default_rng(0)
    q, k, v = _arrays(rng, (2, 70, 4, 64), (2, 90, 2, 64), (2, 90, 2, 64))
    k = np.ascontiguousarray(np.swapaxes(np.ascontiguousarray(np.swapaxes(k, 1, 2)), 1, 2))  # bhsd memory
    p = attention_problem(q.shape, k.shape, v.shape, causal=True, scale=None, window=(-1, -1), softcap=0.0,
                          layout="bshd")  # fmt: skip
    launch = _plan.plan_forward(p, "float16", H200, "fa2", q_shape=q.shape)
    lib = _NumpyLib()
    for _ in range(2):  # the first call checks the layouts, the second takes the straight path
        out, lse = _launch.run(launch, lib, 0, {"q": q, "k": k, "v": v}, True)
    first, second = (call[4] for call in recorder.calls)
    assert first[: launch.params.slot("o_ptr")] == second[: launch.params.slot("o_ptr")]
    values = second
    assert _field(launch, values, "q_ptr") == q.ctypes.data and _field(launch, values, "k_ptr") == k.ctypes.data
    assert [_field(launch, values, f"k_{s}_stride") for s in ("batch", "row", "head")] == [
        s // 2 for s in (k.strides[0], k.strides[1], k.strides[2])
    ]
    assert _field(launch, values, "o_ptr") == out.ctypes.data and _field(launch, values, "lse_ptr") == lse.ctypes.data
    assert _field(launch, values, "window_right") == 0 and _field(launch, values, "h_h_k_ratio") == 2
    assert out.shape == q.shape and lse.shape == (2, 4, 70)


def test_unreadable_operands_are_copied_and_caches_never(recorder):
    rng = np.random.default_rng(1)
    q, k, v = _arrays(rng, (1, 16, 2, 64), (1, 16, 2, 64), (1, 16, 2, 64))
    strided_q = np.asfortranarray(q)  # head_dim not unit-stride
    p = attention_problem(q.shape, k.shape, v.shape, causal=False, scale=-0.1, window=(-1, -1), softcap=0.0,
                          layout="bshd")  # fmt: skip
    launch = _plan.plan_forward(p, "float16", H200, "fa2", q_shape=q.shape)
    _launch.run(launch, _NumpyLib(), 0, {"q": strided_q, "k": k, "v": v}, False)
    values = recorder.calls[-1][4]
    assert _field(launch, values, "q_ptr") != strided_q.ctypes.data  # negated (scale < 0) and copied
    assert _field(launch, values, "q_row_stride") == 2 * 64
    assert _field(launch, values, "lse_ptr") == 0  # not asked for

    kp = kvcache_problem((1, 1, 2, 64), (1, 32, 2, 64), (1, 32, 2, 64), cache_seqlens=5, block_table_shape=None,
                         k_new_shape=None, v_new_shape=None, causal=True, scale=None)  # fmt: skip
    decode = _plan.plan_kvcache(kp, {"q": "float16"}, H200, num_splits=1)
    cache = np.asfortranarray(rng.standard_normal((1, 32, 2, 64)).astype(np.float16))
    with pytest.raises(ValueError, match="k_cache must have a unit stride"):
        _launch.run(decode, _NumpyLib(), 0, {"q": q[:, :1], "k_cache": cache, "v_cache": cache,
                                             "cache_seqlens": 5}, False)  # fmt: skip


def _decode_launch(rng: np.random.Generator) -> tuple[Any, ...]:
    """q, k, v of a decode call (B = 2, 4096 keys, GQA 8/2, d = 128) and its Launch of 4 splits
    over int32 lengths."""
    q, k, v = _arrays(rng, (2, 1, 8, 128), (2, 4096, 2, 128), (2, 4096, 2, 128))
    kp = kvcache_problem(q.shape, k.shape, v.shape, cache_seqlens=0, block_table_shape=None, k_new_shape=None,
                         v_new_shape=None, causal=True, scale=None)  # fmt: skip
    launch = _plan.plan_kvcache(kp, {"q": "float16", "cache_seqlens": "int32"}, H200, num_splits=4)
    return q, k, v, launch


def test_decode_lengths_scratch_and_error_word(recorder):
    q, k, v, launch = _decode_launch(np.random.default_rng(2))
    lib = _NumpyLib()
    lens = np.array([4000, 17], dtype=np.int32)
    for seqlens in (lens, 300):
        _launch.run(launch, lib, 0, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": seqlens}, False)
    array_call, int_call = (call[4] for call in recorder.calls)
    assert _field(launch, array_call, "cache_seqlens") == lens.ctypes.data
    assert _field(launch, int_call, "cache_seqlens") == 0 and _field(launch, int_call, "seqlen_k") == 300
    assert _field(launch, int_call, "num_splits") == 4 and _field(launch, int_call, "error_flags") == 4242
    counters = _field(launch, int_call, "split_counters")
    assert counters and _field(launch, int_call, "o_partial_ptr") > counters
    with pytest.raises(ValueError, match="goes beyond the cache"):
        _launch.run(launch, lib, 0, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": 4097}, False)


def test_an_int_length_given_again_takes_the_straight_path(recorder):
    """An int length given twice in a row goes into the Launch's template (a shared prefix's
    length is the same every decode step): the next call with that int sets only pointers (the
    packed template), while an int that changes every call (a decode loop's growing length) is
    packed once a call, as before; an array, another int, or one out of range still take the
    general way, checked."""
    q, k, v, launch = _decode_launch(np.random.default_rng(3))
    lib = _NumpyLib()
    lens = np.array([4000, 17], dtype=np.int32)
    given = (300, 300, 300, lens, lens, 300, 300, 300, 200, 0, 0, 0)
    straight = (False, False, True, False, True, False, True, True, False, False, False, True)
    for seqlens in given:
        _launch.run(launch, lib, 0, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": seqlens}, False)
        with pytest.raises(ValueError, match="goes beyond the cache"):  # never remembered past its check
            _launch.run(launch, lib, 0, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": 4097}, False)
    calls = recorder.calls
    assert len(calls) == len(given)
    for seqlens, call in zip(given, calls, strict=True):
        values = call[4]
        if type(seqlens) is int:
            assert _field(launch, values, "cache_seqlens") == 0 and _field(launch, values, "seqlen_k") == seqlens
        else:
            assert _field(launch, values, "cache_seqlens") == lens.ctypes.data
    assert tuple(call[6] for call in calls) == straight


def test_an_int_length_past_the_rotary_table_is_refused_per_call(recorder):
    """A plan serves every int cache_seqlens: with rotary tables shorter than the cache, each
    call's int is checked against them by the Launch (the problem was checked with the first
    int only), and one refused is never remembered."""
    rng = np.random.default_rng(4)
    q, k, v = _arrays(rng, (1, 3, 2, 64), (1, 32, 2, 64), (1, 32, 2, 64))
    new = rng.standard_normal((1, 1, 2, 64)).astype(np.float16)
    cos = np.ones((20, 16), np.float16)  # 20 positions; the cache holds 32
    kp = kvcache_problem(q.shape, k.shape, v.shape, cache_seqlens=2, block_table_shape=None, k_new_shape=new.shape,
                         v_new_shape=new.shape, causal=True, scale=None,
                         rotary_shapes=(cos.shape, cos.shape))  # fmt: skip
    assert kp.rotary_max_cached == 17  # three causal queries: the last at cache_seqlens + 2
    launch = _plan.plan_kvcache(kp, {"q": "float16"}, H200, num_splits=1)
    arrays = {"q": q, "k_cache": k, "v_cache": v, "k_new": new, "v_new": new, "rotary_cos": cos, "rotary_sin": cos}
    for seqlens in (17, 17):  # (the second from the template)
        _launch.run(launch, _NumpyLib(), 0, {**arrays, "cache_seqlens": seqlens}, False)
    with pytest.raises(ValueError, match=r"cache_seqlens=18 puts a rotated key or query at position 20, past"):
        _launch.run(launch, _NumpyLib(), 0, {**arrays, "cache_seqlens": 18}, False)
    assert len(recorder.calls) == 2 * len(launch.steps)  # the refused call launched nothing


@pytest.mark.parametrize("algorithm", ["fa2", "fa3"])
def test_varlen_plans_bind_the_error_word(recorder, algorithm):
    """Packed sequences: the forward (FA2 and the Hopper kernel) and every backward step get the
    device error word, from the table of pointers (no allocation, no synchronisation), on every
    call; a padded batch, whose kernels read no device-side offset, gets none."""
    rng = np.random.default_rng(4)
    q, k, v, out, dout = _arrays(rng, (40, 4, 128), (50, 2, 128), (50, 2, 128), (40, 4, 128), (40, 4, 128))
    lse = rng.standard_normal((4, 40)).astype(np.float32)
    cu_q, cu_k = np.array([0, 15, 40], np.int32), np.array([0, 20, 50], np.int32)
    p = varlen_problem(q.shape, k.shape, v.shape, cu_q.shape, cu_k.shape, 25, 30, causal=True, scale=None,
                       window=(-1, -1), softcap=0.0)  # fmt: skip
    lib = _NumpyLib()
    forward = _plan.plan_forward(p, "float16", H200, algorithm, q_shape=q.shape, packed_rows=(40, 50))
    assert forward.error_slot == forward.params.slot("error_flags") >= 0
    arrays = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    for _ in range(2):  # the first call binds the layouts, the second takes the straight path
        _launch.run(forward, lib, 0, arrays, True)
    assert len(recorder.calls) == 2 * len(forward.steps) == 4  # the rows no sequence owns, the kernel
    assert all(_field(forward, call[4], "error_flags") == 4242 for call in recorder.calls)
    assert all(_field(forward, call[4], "cu_seqlens_q") == cu_q.ctypes.data for call in recorder.calls)

    recorder.calls.clear()
    backward = _plan.plan_backward(p, "float16", H200, q_shape=q.shape, k_shape=k.shape, packed_rows=(40, 50))
    assert backward.error_slot == backward.params.slot("error_flags")
    _launch.run_outputs(backward, lib, 0, {**arrays, "out": out, "dout": dout, "lse": lse})
    assert len(recorder.calls) == len(backward.steps) == 4
    assert all(_field(backward, call[4], "error_flags") == 4242 for call in recorder.calls)

    recorder.calls.clear()
    dense = attention_problem((1, 40, 4, 128), (1, 50, 2, 128), (1, 50, 2, 128), causal=True, scale=None,
                              window=(-1, -1), softcap=0.0, layout="bshd")  # fmt: skip
    padded = _plan.plan_forward(dense, "float16", H200, algorithm, q_shape=(1, 40, 4, 128))
    assert padded.error_slot == -1
    _launch.run(padded, lib, 0, {"q": q[None], "k": k[None], "v": v[None]}, False)
    assert _field(padded, recorder.calls[0][4], "error_flags") == 0


def test_layouts_follow_each_call(recorder):
    """A Launch remembers the layouts it found readable; a call with other strides (a view of
    another layout) is bound from its own strides, and an optional operand left out gets the
    plan's strides back (never a previous call's)."""
    rng = np.random.default_rng(3)
    q, k, v, out, dout = _arrays(rng, *[(1, 32, 2, 64)] * 5)
    lse, dlse = (rng.standard_normal((1, 2, 32)).astype(np.float32) for _ in range(2))
    p = attention_problem(q.shape, k.shape, v.shape, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                          layout="bshd")  # fmt: skip
    launch = _plan.plan_backward(p, "float16", H200, q_shape=q.shape, k_shape=k.shape)
    lib = _NumpyLib()
    wide = rng.standard_normal((1, 32, 2, 128)).astype(np.float16)[..., :64]  # row stride 256, not 128
    named = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse}
    for k_now, dlse_now in ((k, dlse), (k, dlse), (wide, None), (k, None), (wide, dlse)):
        launch_values = _launch.run_outputs(launch, lib, 0, {**named, "k": k_now, "dlse": dlse_now})
        assert len(launch_values) == 3
        values = recorder.calls[-1][4]
        assert _field(launch, values, "k_ptr") == k_now.ctypes.data
        assert _field(launch, values, "k_row_stride") == k_now.strides[1] // 2
        assert _field(launch, values, "q_row_stride") == 128
        assert _field(launch, values, "dlse_ptr") == (0 if dlse_now is None else dlse.ctypes.data)
        assert _field(launch, values, "dlse_head_stride") == (0 if dlse_now is None else 32)


def test_merge_part_b_as_an_offset_from_part_a(recorder):
    """merge_states reads part b at a distance from part a: the distance comes from this call's
    pointers, on the first call and on the straight path of the next."""
    rng = np.random.default_rng(4)
    launch = _plan.plan_merge((1, 8, 2, 64), {"o_a": "float16", "lse_a": "float32", "o_b": "float16",
                                              "lse_b": "float32"})  # fmt: skip
    lib = _NumpyLib()
    for _ in range(2):
        o_a, o_b = _arrays(rng, (1, 8, 2, 64), (1, 8, 2, 64))
        lse_a, lse_b = (rng.standard_normal((1, 2, 8)).astype(np.float32) for _ in range(2))
        _launch.run(launch, lib, 0, {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b}, True)
        values = recorder.calls[-1][4]
        assert _field(launch, values, "o_parts_ptr") == o_a.ctypes.data
        assert _field(launch, values, "o_part_stride") == (o_b.ctypes.data - o_a.ctypes.data) // 2
        assert _field(launch, values, "lse_part_stride") == (lse_b.ctypes.data - lse_a.ctypes.data) // 4


def _launches_of_every_kind() -> list:
    """Forward (FA2, the Hopper kernel, the decode kernel), the cache call with an append, the
    backward (plain and deterministic), planned for an H200."""

    def _dense(shapes=((2, 300, 8, 128), (2, 333, 2, 128), (2, 333, 2, 128)), causal=False):
        return attention_problem(*shapes, causal=causal, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")

    long = ((2, 3000, 8, 128), (2, 3000, 2, 128), (2, 3000, 2, 128))
    one = ((4, 1, 8, 128), (4, 4096, 2, 128), (4, 4096, 2, 128))
    kp = kvcache_problem(
        (4, 1, 8, 128), (64, 16, 2, 128), (64, 16, 2, 128), cache_seqlens=5, block_table_shape=(4, 16),
        k_new_shape=(4, 1, 2, 128), v_new_shape=(4, 1, 2, 128), causal=True, scale=None,
    )  # fmt: skip
    p = _dense(causal=True)
    return [
        _plan.plan_forward(p, "bfloat16", H200, "fa2", q_shape=(2, 300, 8, 128)),
        _plan.plan_attention(_dense(shapes=long, causal=True), "bfloat16", H200, "fa3", long[0]),
        _plan.plan_attention(_dense(shapes=one), "bfloat16", H200, "decode", one[0]),
        _plan.plan_kvcache(kp, {"q": "bfloat16", "block_table": "int32"}, H200, num_splits=0),
        _plan.plan_backward(p, "bfloat16", H200, q_shape=(2, 300, 8, 128), k_shape=(2, 333, 2, 128)),
        _plan.plan_backward(
            p, "bfloat16", H200, q_shape=(2, 300, 8, 128), k_shape=(2, 333, 2, 128), deterministic=True
        ),  # fmt: skip
    ]


def test_a_call_that_sets_only_pointers_launches_the_packed_template(monkeypatch):
    """``_launch``'s straight path: a call whose operands' layouts the Launch knows sets only
    pointers (``Launch.pointer_words``), and its kernels get the Launch's template packed once
    with those pointers stored: the same bytes as a pack of every field the call set, for each
    kind of launch (stand-in arrays and kernels, the driver stubbed: bytes, not a GPU). The first
    call (layouts not yet known) packs every field."""
    from cupyflash import _launch, _workspace

    handed = []

    class Driver:
        CUDADriverError = RuntimeError

        @staticmethod
        def launchKernel(function, *args):  # noqa: N802  (the driver's name)
            handed.append(bytes(_kernels._scratch.params_view))

    class Array:
        def __init__(self, shape, dtype, ptr):
            self.shape, self.dtype, self.ptr = tuple(shape), dtype, ptr
            step, strides = 1, []
            for n in reversed(self.shape):
                strides.append(step)
                step *= n
            self.strides = tuple(reversed(strides))

    pointers = iter(range(1 << 20, 1 << 40, 1 << 16))

    class Lib:
        name, wraps = "stand-in", False
        ptr = staticmethod(lambda x: x.ptr)
        raw_strides = strides = staticmethod(lambda x: x.strides)
        stream = staticmethod(lambda device: 0)
        empty = staticmethod(lambda shape, dtype, device, like: Array(shape, dtype, next(pointers)))
        fill = staticmethod(lambda array, value: None)

    monkeypatch.setattr(_kernels, "_driver", lambda: Driver)
    monkeypatch.setattr(_workspace, "stream_scratch", lambda *a, **k: (next(pointers), next(pointers)))
    monkeypatch.setitem(_workspace.error_word_ptrs, 0, next(pointers))
    monkeypatch.setattr(_launch, "_tensor_maps", lambda *a: b"")
    monkeypatch.setattr(_interop, "current_device", lambda: 0)
    packs = []
    real_pack = ParamsStruct.pack_into
    monkeypatch.setattr(ParamsStruct, "pack_into", lambda self, *a: packs.append(self) or real_pack(self, *a))
    for launch in _launches_of_every_kind():
        assert launch.pointer_words
        launch.kernels[:] = [
            _kernels.CompiledKernel(step.spec, "sm_90a", types.SimpleNamespace(ptr=1), 0, 0, 0.0)
            for step in launch.steps
        ]
        seen: list[tuple[list, bool]] = []
        real = _kernels.CompiledKernel.launch

        def spy(self, grid, block, smem, stream, params, maps=None, packed=None, real=real, seen=seen):
            seen.append((list(params), packed is not None))
            real(self, grid, block, smem, stream, params, maps, packed)

        monkeypatch.setattr(_kernels.CompiledKernel, "launch", spy)
        for call in range(3):
            arrays = {}
            for op in launch.operands:
                shape = {"q": (2, 300, 8, 128), "k": (2, 333, 2, 128)}.get(op.name)
                if op.kind in (_launch.TILE, _launch.CONTIGUOUS) and shape is None:
                    shape = (4, 16, 2, 128)
                if shape is not None:
                    arrays[op.name] = Array(shape, "bfloat16", next(pointers))
            handed.clear()
            seen.clear()
            packs.clear()
            _launch._run(launch, Lib, 0, arrays, True, _launch.EMPTY)
            # after the first call no step packs every field (the Hopper backward's Fa3BwdParams has
            # its row kernels' BwdParams fields: the same bytes)
            assert len(packs) == (len(launch.steps) if call == 0 else 0)
            assert all(PARAMS_STRUCTS[s.spec.params_type].fields is launch.params.struct.fields for s in launch.steps)
            size = launch.params.struct.dtype.itemsize
            assert len(seen) == len(handed) == len(launch.steps)
            assert [fast for _, fast in seen] == [call > 0] * len(seen)  # the first call packs every field
            for (values, _fast), got in zip(seen, handed, strict=True):
                assert got[:size] == launch.params.struct.pack_bytes(values), (call, launch.steps)
        monkeypatch.setattr(_kernels.CompiledKernel, "launch", real)
