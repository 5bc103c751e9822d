"""spec -> compiled kernel: compiled once per (spec, device) per process, thread-safe.

At run time the module goes through ``cupy.RawModule``, so CuPy's disk cache keeps the binary
between processes (the fingerprint in the source invalidates it when ``kernels_cu`` changes).
``compile_offline`` runs NVRTC directly for a named arch and needs no GPU: CI uses it to build
every variant for sm_80 and sm_90a, and ``python -m cupyflash warmup --arch`` can use it too.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._params import PARAMS_STRUCTS
from ._source import fingerprint, render
from ._specs import KernelSpec
from ._tma import MAP_BYTES


class KernelCompileError(RuntimeError):
    """NVRTC rejected a variant; the message names the variant and carries the NVRTC log."""


@dataclass(frozen=True)
class CompiledKernel:
    spec: KernelSpec
    arch: str
    function: Any  # cupy.cuda.function.Function
    num_regs: int
    local_bytes: int  # > 0 means registers spilled to local memory
    compile_seconds: float

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int,
        stream_ptr: int,
        params: Sequence[int | float],
        tma_maps: bytes | None = None,
        packed: tuple[Any, bytes, tuple[tuple[int, int], ...]] | None = None,
    ) -> None:
        """Launch with one params-struct argument (AttnParams, DecodeParams ...: the spec's
        ``params_type``, its field values in ``params``; for a TMA kernel, Fa3Params or
        Fa3BwdParams: its 128-byte tensor maps in ``tma_maps``, then those fields), packed into a
        per-thread buffer that cuLaunchKernel reads. CuPy's generic Function call costs ~8 us
        (argument boxing, an __array_interface__ dict per call); this path is one struct pack
        and one driver call. A thread with no current CUDA context (the driver API needs one)
        falls back to CuPy's call, which makes the device's context current first.

        ``packed``: (the struct, ``params`` packed but for the pointers a call sets, and those
        pointers' (slot, word index)), where ``params`` differs from its Launch's template only in
        them (used where the kernel's struct has the same field list: Fa3BwdParams' are
        BwdParams'): the template's bytes copied and one 8-byte store per pointer, ~0.27 us where packing
        every field took 0.9-1.3 us on the 2-core host (AttnParams' 72 fields, DecodeParams' 123)."""
        driver = _driver()
        layout = PARAMS_STRUCTS[self.spec.params_type]
        scratch = _scratch
        if packed is not None and packed[0].fields is layout.fields:  # one field list: the same bytes
            template = packed[1]
            scratch.params_view[: len(template)] = template
            words = scratch.params_words
            for slot, word in packed[2]:  # pointers: ints
                words[word] = params[slot]  # type: ignore[assignment]
        else:
            layout.pack_into(scratch.params_view, params)
        if tma_maps is None:
            kernel_params = scratch.kernel_params[0]
        else:  # the maps end where the params struct starts
            scratch.maps_view[scratch.maps_bytes - len(tma_maps) :] = tma_maps
            kernel_params = scratch.kernel_params[len(tma_maps) // MAP_BYTES]
        try:
            driver.launchKernel(self.function.ptr, *grid, *block, smem, stream_ptr, kernel_params, 0)
        except driver.CUDADriverError:
            import numpy as np

            if tma_maps is None:
                arg = layout.pack(*params)
            else:
                raw = tma_maps + bytes(scratch.params_view[: layout.dtype.itemsize])
                arg = np.frombuffer(raw + bytes(-len(raw) % 64), dtype=np.dtype((np.void, len(raw) + -len(raw) % 64)))
            self.function(grid, block, (arg,), shared_mem=smem, stream=_StreamPtr(stream_ptr))

    def launch_with_buffers(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int,
        stream_ptr: int,
        params: tuple[int | float, ...],
        buffers: tuple[Any, ...],
    ) -> None:
        """Launch a kernel that takes AttnParams and then array arguments (the FA1 scratch, the
        naive softmax's S and P) through CuPy's call (these are not the per-token hot paths)."""
        self.function(
            grid,
            block,
            (PARAMS_STRUCTS[self.spec.params_type].pack(*params), *buffers),
            shared_mem=smem,
            stream=_StreamPtr(stream_ptr),
        )


@functools.cache
def _driver() -> Any:
    """CuPy's driver-API module, imported once (an import statement in the launch path cost
    ~1 us per launch)."""
    from cupy_backends.cuda.api import driver

    return driver


@dataclass(frozen=True)
class _StreamPtr:
    ptr: int


class _LaunchScratch(threading.local):
    """Per-thread kernel-argument memory and the one-entry void* arrays cuLaunchKernel takes (it
    copies the arguments during the call, so reuse is safe). Room for four tensor maps (64-byte
    aligned) at 0 .. 511, then the params struct at 512 (room for the largest): the Hopper
    backward's Fa3BwdParams starts at 0 (four maps), the forward's Fa3Params at 128 (three maps
    at 128, 256, 384), and every other launch points at the params struct alone."""

    MAX_MAPS = 4

    def __init__(self) -> None:
        import numpy as np

        maps_bytes = self.MAX_MAPS * MAP_BYTES
        largest = max(s.dtype.itemsize for s in PARAMS_STRUCTS.values())
        size = maps_bytes + largest
        self.raw = np.zeros(size + 2 * 64, dtype=np.uint8)
        start = -self.raw.ctypes.data % 64
        self.buffer = self.raw[start : start + size + 64]  # covers the structs' 64-byte padding
        self.maps_bytes = maps_bytes
        self.maps_view = self.buffer[:maps_bytes].data
        self.params_view = self.buffer[maps_bytes:size].data
        self.params_words = self.params_view.cast("Q")  # the struct as 8-byte words (its pointers)
        base = self.buffer.ctypes.data
        # Kernel-params arrays: [0] the params struct alone, [n] a struct that starts with n maps.
        starts = [base + maps_bytes] + [base + maps_bytes - n * MAP_BYTES for n in range(1, self.MAX_MAPS + 1)]
        self.pointer_arrays = np.array([[start] for start in starts], dtype=np.uint64)
        self.kernel_params = [int(self.pointer_arrays[i].ctypes.data) for i in range(len(starts))]


_scratch = _LaunchScratch()  # one object; its attributes are per thread


@dataclass(frozen=True)
class OfflineBuild:
    cubin: bytes
    log: str
    seconds: float
    ptx: str = ""  # what NVRTC gave ptxas: the unrolled instruction stream, countable here

    @property
    def stack_bytes(self) -> int:
        """Bytes of stack frame ptxas reported: a register array indexed at run time lands
        there without any spill being reported."""
        for line in self.log.splitlines():
            if "bytes stack frame" in line:
                return int(line.split("bytes stack frame")[0].split()[-1])
        return 0

    @property
    def spill_bytes(self) -> int:
        """Bytes of spill stores ptxas reported (0 for a clean variant)."""
        for line in self.log.splitlines():
            if "spill stores" in line:
                return int(line.split("bytes spill stores")[0].split(",")[-1])
        return 0

    @property
    def warnings(self) -> list[str]:
        """The log's warning lines (NVRTC's ``file(line): warning #607-D: ...``, ptxas's
        ``ptxas warning : ...``); ptxas's ``-v`` lines are ``ptxas info``, not warnings."""
        return [line for line in self.log.splitlines() if re.search(r"\bwarning\b", line, re.IGNORECASE)]

    @property
    def registers(self) -> int | None:
        for line in self.log.splitlines():
            if "Used" in line and "registers" in line:
                return int(line.split("Used")[1].split("registers")[0])
        return None


def arch_option(arch: str) -> str:
    return f"--gpu-architecture={arch}"


def device_arch(device_id: int) -> str:
    """NVRTC target for a device: Hopper gets sm_90a (wgmma, setmaxnreg), others sm_XY."""
    import cupy

    capability = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    return "sm_90a" if capability == "90" else f"sm_{capability}"


def compile_offline(spec: KernelSpec, arch: str) -> OfflineBuild:
    """Compile one variant to a cubin with NVRTC for ``arch``; no GPU or driver needed."""
    from cupy.cuda import nvrtc

    code, options, name = render(spec)
    start = time.perf_counter()
    program = nvrtc.createProgram(code, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*options, arch_option(arch), "--ptxas-options=-v"])
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program).rstrip("\0")
            raise KernelCompileError(f"compiling {name} for {arch} failed ({error}):\n{log}") from None
        log = nvrtc.getProgramLog(program).rstrip("\0")  # NVRTC's log ends in a NUL
        cubin = nvrtc.getCUBIN(program)
        ptx = nvrtc.getPTX(program).decode().rstrip("\0")
    finally:
        nvrtc.destroyProgram(program)
    return OfflineBuild(cubin=cubin, log=log, seconds=time.perf_counter() - start, ptx=ptx)


_compiled: dict[tuple[KernelSpec, int], CompiledKernel] = {}
_key_locks: dict[tuple[KernelSpec, int], threading.Lock] = {}
_registry_lock = threading.Lock()


def get_kernel(spec: KernelSpec, device_id: int) -> CompiledKernel:
    """The compiled variant on a device; the first caller compiles, concurrent callers wait."""
    key = (spec, device_id)
    hit = _compiled.get(key)
    if hit is not None:
        return hit
    with _registry_lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        hit = _compiled.get(key)
        if hit is None:
            hit = _compiled[key] = _compile_for_device(spec, device_id)
    return hit


def _compile_for_device(spec: KernelSpec, device_id: int) -> CompiledKernel:
    import cupy

    code, options, name = render(spec)
    arch = device_arch(device_id)
    if arch.endswith("a"):
        options = (*options, arch_option(arch))
    start = time.perf_counter()
    with cupy.cuda.Device(device_id):
        try:
            raw = cupy.RawModule(code=code, options=options).get_function(name)
            function = raw.kernel  # compiles (or loads from CuPy's disk cache) and loads
        except cupy.cuda.compiler.CompileException as error:
            raise KernelCompileError(f"compiling {name} for {arch} failed:\n{error}") from None
        if spec.smem_bytes > 48 * 1024:
            raw.max_dynamic_shared_size_bytes = spec.smem_bytes
        compiled = CompiledKernel(
            spec=spec,
            arch=arch,
            function=function,
            num_regs=raw.num_regs,
            local_bytes=raw.local_size_bytes,
            compile_seconds=time.perf_counter() - start,
        )
    _record(compiled)
    return compiled


def cache_dir() -> Path:
    """CuPy's kernel cache directory (where the compiled binaries persist between processes)."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


def _index_path() -> Path:
    return cache_dir() / "cupyflash_variants.jsonl"


def _record(kernel: CompiledKernel) -> None:
    """Note a compiled variant in the cache's index (what `python -m cupyflash info` lists)."""
    entry = {
        "name": kernel.spec.name,
        "arch": kernel.arch,
        "registers": kernel.num_regs,
        "local_bytes": kernel.local_bytes,
        "seconds": round(kernel.compile_seconds, 3),
        "fingerprint": fingerprint()[:16],
    }
    try:
        _index_path().parent.mkdir(parents=True, exist_ok=True)
        with _registry_lock, open(_index_path(), "a") as index:
            index.write(json.dumps(entry) + "\n")
    except OSError:  # a read-only cache only loses the listing, never the kernel
        pass


def cached_variants() -> list[dict[str, Any]]:
    """Variants in the disk cache built from the current kernel sources (latest entry each)."""
    try:
        lines = _index_path().read_text().splitlines()
    except OSError:
        return []
    current = fingerprint()[:16]
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("fingerprint") == current:
            entries[(entry["name"], entry["arch"])] = entry
    return sorted(entries.values(), key=lambda e: (e["arch"], e["name"]))


def warmup(
    specs: Iterable[KernelSpec],
    device_id: int,
    *,
    workers: int = 8,
    on_done: Callable[[CompiledKernel], None] | None = None,
) -> list[CompiledKernel]:
    """Compile variants for a device on a thread pool (NVRTC runs without the GIL)."""
    specs = list(specs)
    if not specs:
        return []
    done = [get_kernel(specs[0], device_id)]  # first one alone: loads NVRTC and its builtins
    if on_done:
        on_done(done[0])
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for kernel in pool.map(lambda spec: get_kernel(spec, device_id), specs[1:]):
            done.append(kernel)
            if on_done:
                on_done(kernel)
    return done


def compiled_variants() -> list[CompiledKernel]:
    """Variants compiled by this process so far (for ``python -m cupyflash info``)."""
    return list(_compiled.values())
