"""Arrays in and out: which library an input comes from, where it lives, how the kernels read it,
and on which stream the work is queued.

Two lean paths read pointers, strides and the stream straight from the object (CuPy arrays and
PyTorch CUDA tensors: ``cupy.from_dlpack`` costs ~23 us a tensor on the H200, three of them more
than a whole PyTorch SDPA call). Any other GPU array goes through DLPack without a copy, and
arrays on the host run the array-API algorithms in their own namespace.
"""

from __future__ import annotations

import functools
from typing import Any

HOST = "host"
CUPY = "cupy"
TORCH = "torch"
DLPACK = "dlpack"

# DLPack device types that are GPU memory the kernels can read (kDLCUDA, kDLCUDAManaged).
_DLPACK_GPU_DEVICES = (2, 13)

_kind_of_type: dict[type, str] = {}


def _type_kind(x: Any) -> str:
    cls = type(x)
    kind = _kind_of_type.get(cls)
    if kind is None:
        module = cls.__module__.split(".")[0]
        if module == "cupy" and hasattr(x, "data") and hasattr(x, "device"):
            kind = CUPY
        elif module == "torch" and hasattr(x, "data_ptr"):
            kind = TORCH
        else:
            kind = DLPACK
        _kind_of_type[cls] = kind
    return kind


def same_array_kind(q: Any, k: Any, v: Any) -> str | None:
    """CUPY or TORCH when all three are of that one type (the lean paths), else None."""
    cls = type(q)
    if type(k) is not cls or type(v) is not cls:
        return None
    kind = _kind_of_type.get(cls)
    return kind if kind is not None else _type_kind(q)


def placement(x: Any) -> tuple[str, int]:
    """(kind, device id) of an array: CUPY / TORCH / DLPACK on a GPU, or HOST (-1)."""
    kind = _type_kind(x)
    if kind == CUPY:
        return CUPY, x.device.id
    if kind == TORCH:
        return (TORCH, x.device.index) if x.is_cuda else (HOST, -1)
    dlpack_device = getattr(x, "__dlpack_device__", None)
    if dlpack_device is not None:
        device_type, device_id = dlpack_device()
        if int(device_type) in _DLPACK_GPU_DEVICES:
            return DLPACK, int(device_id)
    return HOST, -1


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _describe(kind: str, device: int, x: Any) -> str:
    where = "the host" if kind == HOST else f"GPU {device}"
    return f"a {_library(x)} array on {where}"


def common_placement(**arrays: Any) -> tuple[str, int]:
    """The one (kind, device) shared by all arrays, or a ValueError naming the odd one out."""
    items = list(arrays.items())
    first_name, first = items[0]
    kind, device = placement(first)
    library = _library(first)
    for name, x in items[1:]:
        other = placement(x)
        if other != (kind, device) or _library(x) != library:
            raise ValueError(
                f"{first_name} is {_describe(kind, device, first)} but {name} is "
                f"{_describe(*other, x)}: all inputs must be arrays of one library on one device"
            )
    return kind, device


# ---------------------------------------------------------------------------------------------
# Streams.
# ---------------------------------------------------------------------------------------------
def torch_current_stream(device_index: int) -> int:
    """PyTorch's current stream on a device, as a raw pointer (the raw getter is 5 us faster
    than torch.cuda.current_stream())."""
    return int(_torch_stream_getter()(device_index))


@functools.cache
def _torch_stream_getter() -> Any:
    """Looked up once: an import statement on the per-call path costs ~1 us."""
    import torch

    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter
    return lambda device_index: torch.cuda.current_stream(device_index).cuda_stream


@functools.cache
def torch_module() -> Any:
    """``torch``, imported once (for per-call paths: an import statement costs ~1 us there)."""
    import torch

    return torch


@functools.cache
def cupy_module() -> Any:
    """``cupy``, imported once, as torch_module."""
    import cupy

    return cupy


def current_device() -> int:
    """The current CUDA device of this thread (CuPy's runtime view)."""
    return int(_get_device()())


@functools.cache
def _get_device() -> Any:
    from cupy_backends.cuda.api import runtime

    return runtime.getDevice


# ---------------------------------------------------------------------------------------------
# What the kernels need of a GPU array, read without copies.
# ---------------------------------------------------------------------------------------------
_element_strides: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}


def element_strides(x: Any) -> tuple[int, ...]:
    """Strides of a CuPy array in elements (CuPy reports bytes); memoised, a call is hot."""
    key = (x.strides, x.itemsize)
    strides = _element_strides.get(key)
    if strides is None:
        if len(_element_strides) > 4096:
            _element_strides.clear()
        strides = _element_strides[key] = tuple(s // key[1] for s in key[0])
    return strides


def kernel_readable(ptr: int, shape: Any, strides: Any) -> bool:
    """Unit stride on head_dim, 16-byte aligned base and strides (cp.async and TMA move 16-byte
    chunks), no negative stride (a TMA tensor map takes unsigned strides).

    Strides of size-1 axes are never used, so they may be anything.
    """
    if ptr % 16 or (strides[-1] != 1 and shape[-1] > 1):
        return False
    for size, stride in zip(shape[:-1], strides[:-1]):
        if (stride % 8 or stride < 0) and size > 1:
            return False
    return True


def readable_copy(kind: str, x: Any) -> Any:
    """A fresh C-contiguous copy (new, aligned allocation) in the caller's own library."""
    if kind == TORCH:
        import torch

        return x.clone(memory_format=torch.contiguous_format)
    return x.copy(order="C")


@functools.cache
def device_attribute(device: int, name: str) -> int:
    """A CUDA device attribute (MaxSharedMemoryPerBlockOptin, MultiProcessorCount ...), read once
    per device: plans need them, and the driver query is not free."""
    import cupy

    return int(cupy.cuda.Device(device).attributes[name])
