"""Per-stream device scratch for kernels whose CTAs coordinate through counters.

The split-KV decode kernel counts the splits that have finished each output row (the last one
merges them), so its counters must read 0 when it starts. Zeroing them per call would cost an
allocation and a memset launch on the decode hot path; instead each (library, device, stream)
keeps one buffer whose counter region was zeroed once, when it was allocated, and that every
kernel using it sets back to 0 before it exits. The rest of the buffer is scratch with no
initial value (the splits' partial O and LSE). Calls on one stream run in order, so they share
the buffer; each stream has its own. The default-stream handles (0, the legacy stream; 1 and 2,
the per-thread ones) name a different stream, or are used concurrently, from each thread, so
there the buffer is per thread too. A buffer that grows at least doubles, and the one it
replaces stays allocated (another thread may hold its pointer for a launch still to come).

A call made while its stream is captured into a CUDA graph gets a buffer of its own instead,
zeroed by a memset captured with it (so every replay starts from 0): a graph can be replayed at
any time, and must share its scratch with no eager call and no other graph. PyTorch keeps
memory freed during a capture in the graph's own pool, reused only by later nodes of the same
graph (which run after this kernel); other libraries give no such promise, so their buffers are
kept as long as the process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ._interop import TORCH, ArrayLib, stream_is_capturing

_ALIGN = 256  # bytes: the scratch region starts on a fresh 256-byte line


@dataclass(frozen=True)
class _Buffer:
    array: Any  # float32, 1-D, in the caller's library
    ptr: int
    counter_bytes: int  # zeroed, rounded up to _ALIGN
    scratch_bytes: int


_buffers: dict[tuple[str, int, int, int], _Buffer] = {}
_retired: list[Any] = []  # buffers replaced by larger ones: a pointer may still be in use
_captured: list[Any] = []  # non-PyTorch buffers of captured calls: alive while the process is
_last_captured: list[Any] = []  # PyTorch: the latest one, alive until its kernel is captured
_DEFAULT_STREAM_HANDLES = (0, 1, 2)
# A process that makes streams without end keeps this many buffers; dropping the oldest is safe
# (its library frees it in the order of the stream it was allocated on, after its last kernel).
_MAX_STREAM_BUFFERS = 64


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _zeros(lib: ArrayLib, device: int, nbytes: int) -> Any:
    array = lib.empty((max(nbytes // 4, 1),), "float32", device)
    lib.fill(array, 0.0)
    return array


def stream_scratch(
    lib: ArrayLib, device: int, stream: int, counter_bytes: int, scratch_bytes: int, *, poison: bool = False
) -> tuple[int, int]:
    """(counters, scratch) device pointers for one launch on ``stream``: ``counter_bytes`` that
    read 0 and must be left at 0 by the kernel, then ``scratch_bytes`` of anything, 256-byte
    aligned. ``lib`` is the caller's array library, whose allocator (and its stream-ordered
    reuse, or a graph's memory pool while capturing) holds the memory.
    ``poison`` fills the scratch with NaN first (tests: a read of an unwritten part shows)."""
    counters = _round_up(counter_bytes)
    kind = lib.name
    if stream_is_capturing(stream):
        array = _zeros(lib, device, counters + scratch_bytes)
        buffer = _Buffer(array, lib.ptr(array), counters, scratch_bytes)
        if kind == TORCH:
            _last_captured[:] = [buffer.array]
        else:
            _captured.append(buffer.array)
    else:
        key = (kind, device, stream, threading.get_ident() if stream in _DEFAULT_STREAM_HANDLES else 0)
        found = _buffers.get(key)
        if found is None or found.counter_bytes < counters or found.scratch_bytes < scratch_bytes:
            if found is not None:  # grow (at least double) to cover the old and the new call
                if counters > found.counter_bytes:
                    counters = max(counters, 2 * found.counter_bytes)
                if scratch_bytes > found.scratch_bytes:
                    scratch_bytes = max(scratch_bytes, 2 * found.scratch_bytes)
                counters = max(counters, found.counter_bytes)
                scratch_bytes = max(scratch_bytes, found.scratch_bytes)
                _retired.append(_buffers.pop(key).array)
            array = _zeros(lib, device, counters + scratch_bytes)
            if len(_buffers) >= _MAX_STREAM_BUFFERS:
                del _buffers[next(iter(_buffers))]
            found = _buffers[key] = _Buffer(array, lib.ptr(array), counters, scratch_bytes)
        buffer = found
    if poison:
        lib.fill(buffer.array[buffer.counter_bytes // 4 :], float("nan"))
    return buffer.ptr, buffer.ptr + buffer.counter_bytes


# ---------------------------------------------------------------------------------------------
# The device error word: bits the decode kernels OR in when a device-side value is out of range
# (a block-table entry outside the cache, a sequence length beyond it). One int32 per device,
# alive as long as the process; ``take_device_errors`` reads and clears it.
# ---------------------------------------------------------------------------------------------
_error_words: dict[int, Any] = {}  # device -> the CuPy array (kept alive)
error_word_ptrs: dict[int, int] = {}  # device -> its pointer (reading .data.ptr costs ~1 us)


def device_error_word(device: int, stream: int) -> int:
    """The pointer of ``device``'s error word, or 0 (no reporting) when the first call to need it
    runs inside a CUDA-graph capture, where allocating and zeroing it cannot be captured."""
    ptr = error_word_ptrs.get(device)
    if ptr is None:
        if stream_is_capturing(stream):
            return 0
        import cupy

        with cupy.cuda.Device(device):
            word = _error_words[device] = cupy.zeros((1,), dtype=cupy.int32)
        ptr = error_word_ptrs[device] = int(word.data.ptr)
    return ptr


def take_device_errors(device: int) -> int:
    """The bits set on ``device`` since the last call (after every queued kernel has run), and
    clear them."""
    word = _error_words.get(device)
    if word is None:
        return 0
    import cupy

    with cupy.cuda.Device(device):
        cupy.cuda.Device(device).synchronize()
        bits = int(word.get()[0])
        word.fill(0)
        cupy.cuda.Device(device).synchronize()
    return bits
