"""Host time of ``_launch._run`` per call (binding the operands, allocating the outputs, packing
the params, the driver call), with the driver stubbed and stand-in arrays: no GPU needed.
``scripts/host_overhead.py`` times what comes before it (it stubs ``_launch.run`` whole).

    PYTHONPATH=TREE python scripts/launch_overhead.py    # the cupyflash of TREE (an older export too)

Launches planned for an H200: the FA2 forward, the Hopper forward (its tensor maps stubbed), the
decode kernel, a cache call with its append, the backward. Microseconds per call, the fastest of
7 rounds of 20,000 calls of a signature already met.
"""

from __future__ import annotations

import timeit
import types
from typing import Any

from cupyflash import _device, _interop, _kernels, _launch, _plan, _workspace
from cupyflash._validate import attention_problem, kvcache_problem

H200 = _device.HOPPER


class _Driver:
    CUDADriverError = RuntimeError

    @staticmethod
    def launchKernel(*args: Any) -> None:  # noqa: N802  (the driver's name)
        pass


class _Array:
    """A C-contiguous stand-in: shape, element strides, a pointer."""

    def __init__(self, shape: tuple[int, ...], ptr: int) -> None:
        self.shape, self.ptr = tuple(shape), ptr
        step, strides = 1, []
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        self.strides = tuple(reversed(strides))


class _Lib:
    name, wraps = "stand-in", False
    ptr = staticmethod(lambda x: x.ptr)
    raw_strides = strides = staticmethod(lambda x: x.strides)
    stream = staticmethod(lambda device: 0)
    empty = staticmethod(lambda shape, dtype, device, like: _Array(shape, 1 << 30))
    fill = staticmethod(lambda array, value: None)


def _stub() -> None:
    _kernels._driver = lambda: _Driver  # type: ignore[assignment]
    _workspace.stream_scratch = lambda *args, **kwargs: (1 << 32, 1 << 33)  # type: ignore[assignment]
    _workspace.error_word_ptrs[0] = 1 << 34
    _interop.current_device = lambda: 0  # type: ignore[assignment]
    _launch.POISON_OUTPUTS = False
    _launch._tensor_maps = lambda *args: b""  # type: ignore[assignment]


def _cases() -> dict[str, tuple[Any, tuple[int, ...]]]:
    def dense(shapes: Any, causal: bool = False) -> Any:
        return attention_problem(*shapes, causal=causal, scale=None, window=(-1, -1), softcap=0.0, layout="bshd")

    prefill = ((2, 300, 8, 128), (2, 333, 2, 128), (2, 333, 2, 128))
    long = ((2, 3000, 8, 128), (2, 3000, 2, 128), (2, 3000, 2, 128))
    one = ((4, 1, 8, 128), (4, 4096, 2, 128), (4, 4096, 2, 128))
    kp = kvcache_problem(
        (4, 1, 8, 128), (64, 16, 2, 128), (64, 16, 2, 128), cache_seqlens=5, block_table_shape=(4, 16),
        k_new_shape=(4, 1, 2, 128), v_new_shape=(4, 1, 2, 128), causal=True, scale=None,
    )  # fmt: skip
    p = dense(prefill, True)
    return {
        "FA2 forward": (_plan.plan_forward(p, "bfloat16", H200, "fa2", q_shape=prefill[0]), prefill[0]),
        "Hopper forward": (_plan.plan_attention(dense(long, True), "bfloat16", H200, "fa3", long[0]), prefill[0]),
        "decode": (_plan.plan_attention(dense(one), "bfloat16", H200, "decode", one[0]), one[0]),
        "cache call + append": (
            _plan.plan_kvcache(kp, {"q": "bfloat16", "block_table": "int32"}, H200, num_splits=0),
            prefill[0],
        ),  # fmt: skip
        "backward": (_plan.plan_backward(p, "bfloat16", H200, q_shape=prefill[0], k_shape=prefill[1]), prefill[0]),
    }


def main() -> None:
    _stub()
    for name, (launch, q_shape) in _cases().items():
        fake = types.SimpleNamespace(ptr=1)
        launch.kernels[:] = [_kernels.CompiledKernel(s.spec, "sm_90a", fake, 0, 0, 0.0) for s in launch.steps]
        arrays = {}
        for op in launch.operands:
            shape = {"q": q_shape, "k": (2, 333, 2, 128)}.get(op.name)
            if op.kind in (_launch.TILE, _launch.CONTIGUOUS) and shape is None:
                shape = (4, 16, 2, 128)
            if shape is not None:
                arrays[op.name] = _Array(shape, 1 << 24)

        def call(launch: Any = launch, arrays: Any = arrays) -> None:
            _launch._run(launch, _Lib, 0, arrays, True, _launch.EMPTY)

        call()
        call()
        us = min(timeit.repeat(call, number=20000, repeat=7)) / 20000 * 1e6
        print(f"{name:20s} {len(launch.steps)} step(s) {us:5.2f} us")


if __name__ == "__main__":
    main()
