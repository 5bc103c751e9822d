"""The per-stream scratch's bookkeeping (cupyflash/_workspace.py), with NumPy standing in for the
device allocator: reuse per stream, growth, the captured-call buffers, the cap on streams."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cupyflash
from cupyflash import _interop, _workspace


class _NumpyLib(_interop.ArrayLib):
    """An array library whose "device" memory is NumPy's, counting its allocations."""

    def __init__(self, name: str, state: dict[str, int]) -> None:
        self.name = name
        self.state = state

    def empty(self, shape, dtype, device, like=None):  # type: ignore[no-untyped-def]
        self.state["allocations"] += 1
        return np.empty(shape, dtype=dtype)

    def fill(self, x, value):  # type: ignore[no-untyped-def]
        x.fill(value)

    def ptr(self, x):  # type: ignore[no-untyped-def]
        return x.ctypes.data


_STATE = {"allocations": 0}
TORCH = _NumpyLib("torch", _STATE)
CUPY = _NumpyLib("cupy", _STATE)


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    state: dict[str, object] = {"capturing": False}
    _STATE["allocations"] = 0
    monkeypatch.setattr(_workspace, "stream_is_capturing", lambda stream: state["capturing"])
    monkeypatch.setattr(_workspace, "_buffers", {})
    monkeypatch.setattr(_workspace, "_retired", [])
    monkeypatch.setattr(_workspace, "_captured", [])
    monkeypatch.setattr(_workspace, "_last_captured", [])
    return state


def test_one_buffer_per_stream_reused_and_grown(fake_device):
    counters, scratch = _workspace.stream_scratch(TORCH, 0, 7, 12, 1000)
    assert scratch - counters == 256 and counters % 4 == 0  # counters padded to a 256-byte line
    assert _workspace.stream_scratch(TORCH, 0, 7, 8, 500) == (counters, scratch)  # reused
    assert _STATE["allocations"] == 1
    other = _workspace.stream_scratch(TORCH, 0, 8, 8, 500)
    assert other[0] != counters and _STATE["allocations"] == 2  # another stream, its own
    grown = _workspace.stream_scratch(TORCH, 0, 7, 4 * 300, 10)  # more counters, less scratch
    buffer = _workspace._buffers[("torch", 0, 7, 0)]
    assert buffer.counter_bytes == 1280 and buffer.scratch_bytes == 1000  # covers both calls
    assert grown[1] - grown[0] == 1280
    assert not buffer.array[: 1280 // 4].any()  # the counters start at 0
    assert len(_workspace._retired) == 1  # the replaced buffer stays allocated
    _workspace.stream_scratch(TORCH, 0, 7, 8, 1001)  # scratch one byte more: at least doubled
    assert _workspace._buffers[("torch", 0, 7, 0)].scratch_bytes == 2000


def test_captured_calls_get_buffers_of_their_own(fake_device):
    eager = _workspace.stream_scratch(CUPY, 0, 3, 8, 64)
    fake_device["capturing"] = True
    first = _workspace.stream_scratch(CUPY, 0, 3, 8, 64)
    second = _workspace.stream_scratch(CUPY, 0, 3, 8, 64)
    assert len({eager, first, second}) == 3 and len(_workspace._captured) == 2  # kept for good
    _workspace.stream_scratch(TORCH, 0, 3, 8, 64)
    _workspace.stream_scratch(TORCH, 0, 3, 8, 64)
    assert len(_workspace._captured) == 2 and len(_workspace._last_captured) == 1  # the graph's pool keeps them
    fake_device["capturing"] = False
    assert _workspace.stream_scratch(CUPY, 0, 3, 8, 64) == eager


def test_poison_fills_only_the_scratch(fake_device):
    _workspace.stream_scratch(CUPY, 0, 1, 8, 64, poison=True)
    array = _workspace._buffers[("cupy", 0, 1, threading.get_ident())].array
    assert not array[:64].any() and np.isnan(array[64:]).all()


def test_streams_beyond_the_cap_drop_the_oldest(fake_device, monkeypatch):
    monkeypatch.setattr(_workspace, "_MAX_STREAM_BUFFERS", 3)
    for stream in range(5):
        _workspace.stream_scratch(TORCH, 0, stream, 8, 0)
    assert [key[2] for key in _workspace._buffers] == [2, 3, 4]


def test_default_stream_handles_are_per_thread(fake_device):
    """Handle 0 (legacy) and 2 (per-thread default) are used by many threads: one buffer each."""
    here = {h: _workspace.stream_scratch(CUPY, 0, h, 8, 64) for h in (0, 2, 9)}
    there = {}
    worker = threading.Thread(
        target=lambda: there.update({h: _workspace.stream_scratch(CUPY, 0, h, 8, 64) for h in (0, 2, 9)})
    )
    worker.start()
    worker.join()
    assert here[0] != there[0] and here[2] != there[2]
    assert here[9] == there[9]  # an explicit stream is one stream in every thread


def test_the_error_word_is_made_outside_a_capture(monkeypatch):
    """The first call to need the word allocates it (zeroed) and keeps its pointer; later calls
    read the table; a first call inside a CUDA-graph capture gets 0 (no reporting) instead of an
    allocation the capture would refuse."""
    monkeypatch.setattr(_workspace, "error_word_ptrs", {})
    monkeypatch.setattr(_workspace, "stream_is_capturing", lambda stream: True)
    assert _workspace.device_error_word(0, 7) == 0 and _workspace.error_word_ptrs == {}


def test_device_errors_name_each_bad_value(monkeypatch):
    """check_device_errors turns the bits the kernels set into one DeviceValueError that names
    each kind of value met (cu_seqlens_q and cu_seqlens_k apart), and raises nothing once the
    word reads 0 (the read clears it)."""
    taken = iter([8 | 32, 16, 1 | 2, 0])
    monkeypatch.setattr(_workspace, "take_device_errors", lambda device: next(taken))
    with pytest.raises(cupyflash.DeviceValueError, match="on GPU 0") as info:
        cupyflash.check_device_errors(0)
    message = str(info.value)
    assert "a cu_seqlens_q value was negative, decreasing or past the packed total" in message
    assert "seqused_k value was outside [0, its sequence's key count]" in message
    assert "cu_seqlens_k" not in message and "block_table" not in message
    with pytest.raises(cupyflash.DeviceValueError, match="a cu_seqlens_k value was negative, decreasing"):
        cupyflash.check_device_errors(0)
    with pytest.raises(cupyflash.DeviceValueError, match="block_table entry.*; a cache_seqlens value"):
        cupyflash.check_device_errors(0)
    cupyflash.check_device_errors(0)
