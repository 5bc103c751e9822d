"""The array protocol: everything that differs between CuPy arrays, PyTorch tensors and other
DLPack GPU arrays, behind one small interface (``ArrayLib``) with one implementation per library.
No other module asks which library an array comes from.

``gpu_arrays(...)`` is the one entry: it finds the library and GPU that all of a call's arrays
share (or says why they do not), and hands back the ``ArrayLib`` that reads pointers, strides
and the caller's stream, allocates outputs, and wraps the results back into the caller's type.
CuPy arrays and PyTorch CUDA tensors are read straight from the object (``cupy.from_dlpack``
costs ~23 us a tensor on the H200, three of them more than a whole PyTorch SDPA call); any other
GPU array (JAX ...) is adopted into CuPy through DLPack once, at the entry, without a copy, and
its results are handed back through DLPack once, at the exit. Host arrays return None: the
caller runs the array-API algorithms in their own namespace. JAX tracers (``jax.jit``, grad,
vmap) have no memory: ``traced`` finds them, and the front door hands the calls of
``attention`` and ``attention_with_kvcache`` to ``_jax``, which runs the same pipeline inside the
XLA program on the buffers XLA gives it. This module imports no other part of cupyflash.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

# DLPack device types that are GPU memory the kernels can read (kDLCUDA, kDLCUDAManaged).
_DLPACK_GPU_DEVICES = (2, 13)

CUPY = "cupy"
TORCH = "torch"
DLPACK = "dlpack"
TRACED = "traced"  # a JAX tracer (jax.jit, grad, vmap): no memory behind it


#: What runs when cupyflash first meets PyTorch (``when_torch_imported``): the front door's
#: loading of its custom ops, so that they exist before any call is traced.
_torch_hooks: list[Callable[[], Any]] = []


def when_torch_imported(hook: Callable[[], Any]) -> None:
    """Run ``hook`` once cupyflash first imports torch (``torch_module``): how an adapter gets
    registered without this module importing it."""
    _torch_hooks.append(hook)


@functools.cache
def torch_module() -> Any:
    """``torch``, imported once (for per-call paths: an import statement costs ~1 us there), and
    the ``when_torch_imported`` hooks run."""
    import torch

    for hook in _torch_hooks:
        hook()
    return torch


@functools.cache
def cupy_module() -> Any:
    """``cupy``, imported once, as torch_module."""
    import cupy

    return cupy


@functools.cache
def _runtime() -> Any:
    from cupy_backends.cuda.api import runtime

    return runtime


def current_device() -> int:
    """The current CUDA device of this thread (CuPy's runtime view)."""
    return int(_runtime().getDevice())


def stream_is_capturing(stream: int) -> bool:
    """Is ``stream`` being captured into a CUDA graph?"""
    return bool(_runtime().streamIsCapturing(stream))


class ArrayLib:
    """What the GPU pipeline needs of one array library. Strides are in elements; dtypes are
    named by their NumPy names ("float16", "bfloat16", "float32", "int32" ...)."""

    name: str

    def ptr(self, x: Any) -> int:
        raise NotImplementedError

    def strides(self, x: Any) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype_name(self, x: Any) -> str:
        raise NotImplementedError

    def empty(self, shape: Sequence[int], dtype: str, device: int, like: Any = None) -> Any:
        """A new array on ``device`` (``like``, an array of this library on it, may make that cheaper)."""
        raise NotImplementedError

    def fill(self, x: Any, value: float) -> None:
        raise NotImplementedError

    def copy(self, x: Any) -> Any:
        """A fresh C-contiguous copy (a new, aligned allocation), queued on the caller's stream."""
        raise NotImplementedError

    def stream(self, device: int) -> int:
        """The caller's current stream on ``device``, as a raw pointer."""
        raise NotImplementedError

    def raw_strides(self, x: Any) -> tuple[int, ...]:
        """The strides as the library reports them (a per-call cache key; bytes for CuPy)."""
        raise NotImplementedError

    def check_inputs(self, arrays: Sequence[Any]) -> bool:
        """Whether the call must go through autograd (PyTorch tensors that require grad, with
        grad mode on): the entry points with a backward route it (``_torch_ops``), the others
        refuse it (``refuse_autograd``)."""
        return False

    #: Whether results need ``wrap`` (only DLPack-adopted arrays: the others are the caller's).
    wraps = False

    def wrap(self, x: Any) -> Any:
        """A result in the caller's type (the identity but for DLPack-adopted arrays)."""
        return x


class CupyLib(ArrayLib):
    name = CUPY

    def __init__(self) -> None:
        self._strides: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}

    def ptr(self, x: Any) -> int:
        return x.data.ptr  # already an int (a MemoryPointer's address)

    def raw_strides(self, x: Any) -> tuple[int, ...]:
        return x.strides  # bytes

    def strides(self, x: Any) -> tuple[int, ...]:
        # CuPy reports bytes; memoised by (byte strides, itemsize).
        key = (x.strides, x.itemsize)
        strides = self._strides.get(key)
        if strides is None:
            if len(self._strides) > 4096:
                self._strides.clear()
            strides = self._strides[key] = tuple(s // key[1] for s in key[0])
        return strides

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype.name)

    def empty(self, shape: Sequence[int], dtype: str, device: int, like: Any = None) -> Any:
        return cupy_module().empty(shape, dtype=_numpy_dtype(dtype))

    def fill(self, x: Any, value: float) -> None:
        x.fill(value)

    def copy(self, x: Any) -> Any:
        return x.copy(order="C")

    def stream(self, device: int) -> int:
        return int(cupy_module().cuda.get_current_stream().ptr)


@functools.cache
def _numpy_dtype(name: str) -> Any:
    """The NumPy dtype CuPy allocates with ("bfloat16" is ml_dtypes', known once it is imported)."""
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class TorchLib(ArrayLib):
    name = TORCH

    def __init__(self) -> None:
        self._dtypes: dict[str, Any] = {}
        self._devices: dict[int, Any] = {}
        self._stream_getter: Any = None

    def ptr(self, x: Any) -> int:
        return x.data_ptr()

    def strides(self, x: Any) -> tuple[int, ...]:
        return x.stride()  # already a tuple of ints, in elements

    raw_strides = strides

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    def _dtype(self, name: str) -> Any:
        dtype = self._dtypes.get(name)
        if dtype is None:
            dtype = self._dtypes[name] = getattr(torch_module(), name)
        return dtype

    def empty(self, shape: Sequence[int], dtype: str, device: int, like: Any = None) -> Any:
        if like is not None:  # 2 us less than torch.empty(..., device=) on the H200 machine
            return like.new_empty(shape, dtype=self._dtypes.get(dtype) or self._dtype(dtype))
        where = self._devices.get(device)
        if where is None:  # parsing "cuda:N" per call costs ~1 us
            where = self._devices[device] = torch_module().device("cuda", device)
        return torch_module().empty(shape, dtype=self._dtype(dtype), device=where)

    def fill(self, x: Any, value: float) -> None:
        x.fill_(value)

    def copy(self, x: Any) -> Any:
        return x.clone(memory_format=torch_module().contiguous_format)

    def stream(self, device: int) -> int:
        getter = self._stream_getter
        if getter is None:  # the raw getter is 5 us faster than torch.cuda.current_stream()
            torch = torch_module()
            getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if getter is None:
                getter = lambda index: torch.cuda.current_stream(index).cuda_stream  # noqa: E731
            self._stream_getter = getter
        return int(getter(device))

    def check_inputs(self, arrays: Sequence[Any]) -> bool:
        # A kernel launch is invisible to autograd: a tensor that requires grad must go through
        # the custom op, which has a backward, or it would come back detached.
        for x in arrays:
            if x is not None and x.requires_grad:
                return bool(torch_module().is_grad_enabled())
        return False


def refuse_slope_grad(slopes: Any) -> None:
    """ALiBi's slopes are constants (as in flash-attn): slopes that require grad would silently get
    no gradient."""
    if needs_autograd((slopes,)):
        raise RuntimeError(
            "alibi_slopes require grad, but ALiBi's slopes get no gradient (as in flash-attn): pass them detached"
        )


def dropout_capture_error() -> ValueError:
    """Dropout without a seed inside CUDA-graph capture: the seed is a launch parameter."""
    return ValueError(
        "dropout under CUDA graph capture needs an explicit seed=: the seed is a launch parameter, so every replay "
        "of the graph repeats the captured call's dropout mask (pass seed= to accept that, or run dropout eagerly)"
    )


def draw_seed(x: Any) -> int:
    """A fresh dropout seed for a call whose caller gave none: from PyTorch's default generator
    for tensors (``torch.manual_seed`` makes it reproducible, as for SDPA's dropout), else from
    Python's ``random`` (``random.seed``)."""
    if _kind(x) == TORCH:
        return int(torch_module().randint(0, 2**63 - 1, ()))
    return random.getrandbits(64)


def needs_autograd(arrays: Sequence[Any]) -> bool:
    """Host arrays: PyTorch CPU tensors that require grad, with grad mode on."""
    return TORCH_LIB.check_inputs(arrays) if _kind(arrays[0]) == TORCH else False


def refuse_autograd(entry: str) -> NoReturn:
    raise RuntimeError(
        f"{entry} has no backward pass: an input that requires grad would come back detached with no gradient. "
        "Call it under torch.no_grad() or pass tensors that do not require grad."
    )


#: ``torch.compiler.is_compiling`` once cupyflash's torch ops exist (``_torch_ops`` registers it),
#: so that a call Dynamo traces goes straight to the custom op; False before: ``bool()``, a C call
#: (a Python function returning False cost every call ~10 ns more).
compiling: Callable[[], bool] = bool


class DlpackLib(CupyLib):
    """Other GPU arrays, adopted into CuPy at the entry; results go back through DLPack."""

    name = DLPACK
    wraps = True

    def __init__(self, namespace: Any) -> None:
        super().__init__()
        self.namespace = namespace

    def wrap(self, x: Any) -> Any:
        return self.namespace.from_dlpack(x)


CUPY_LIB = CupyLib()
TORCH_LIB = TorchLib()

# type -> library name of its arrays (a tensor subclass such as nn.Parameter is a torch tensor).
_kind_of_type: dict[type, str] = {}


def _kind(x: Any) -> str:
    cls = type(x)
    kind = _kind_of_type.get(cls)
    if kind is None:
        modules = {c.__module__.split(".")[0] for c in cls.__mro__}
        if "cupy" in modules and hasattr(x, "data") and hasattr(x, "device"):
            kind = CUPY
        elif "torch" in modules and hasattr(x, "data_ptr"):
            kind = TORCH
        elif any(c.__name__ == "Tracer" and c.__module__.startswith("jax") for c in cls.__mro__):
            kind = TRACED
        else:
            kind = DLPACK
        _kind_of_type[cls] = kind
    return kind


def _device_of(kind: str, x: Any) -> int:
    """The GPU an array lives on, or -1 on the host."""
    if kind == CUPY:
        return int(x.data.device_id)
    if kind == TORCH:
        return int(x.get_device())
    dlpack_device = getattr(x, "__dlpack_device__", None)
    if dlpack_device is not None:
        device_type, device_id = dlpack_device()
        if int(device_type) in _DLPACK_GPU_DEVICES:
            return int(device_id)
    return -1


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _describe(x: Any) -> str:
    kind = _kind(x)
    device = _device_of(kind, x)
    where = "the host" if device < 0 else f"GPU {device}"
    return f"a {_library(x)} array on {where}"


def gpu_arrays(names: Sequence[str], arrays: Sequence[Any]) -> tuple[ArrayLib, int, list[Any]] | None:
    """(library, device, arrays as the pipeline reads them) for a call on the GPU, or None when
    every array is on the host. ``None`` entries (absent optional arguments) are skipped.

    All arrays must be of one library on one device, else a ValueError names the odd one out.
    DLPack-only arrays are adopted into CuPy here, once.
    """
    for name, x in zip(names, arrays):
        if x is not None and not _is_array(x):
            raise TypeError(f"{name} must be an array (CuPy, PyTorch, JAX, NumPy ...), got {type(x).__name__}")
        if x is not None and _kind(x) == TRACED:
            _refuse_traced(name)
    first = next(i for i, x in enumerate(arrays) if x is not None)
    kind = _kind(arrays[first])
    device = _device_of(kind, arrays[first])
    for i, x in enumerate(arrays):
        if x is None or i == first:
            continue
        if _kind(x) != kind or _device_of(kind, x) != device or _library(x) != _library(arrays[first]):
            raise ValueError(
                f"{names[first]} is {_describe(arrays[first])} but {names[i]} is {_describe(x)}: all inputs must "
                "be arrays of one library on one device"
            )
    if kind == CUPY:
        return CUPY_LIB, device, list(arrays)
    if kind == TORCH:
        if device < 0:
            return None
        return TORCH_LIB, device, list(arrays)
    if device < 0:
        return None
    from array_api_compat import array_namespace

    cupy = cupy_module()
    namespace = array_namespace(arrays[first])
    adopted = [None if x is None else cupy.from_dlpack(x) for x in arrays]
    return DlpackLib(namespace), device, adopted


def gpu_of_device(device: Any) -> tuple[ArrayLib, int] | None:
    """The library and GPU a ``device=`` argument names, or None for the host: ``"cuda"``,
    ``"cuda:N"`` or a ``torch.device`` (PyTorch's current GPU, or GPU N), an int or a
    ``cupy.cuda.Device`` (CuPy's GPU N), ``"cpu"`` (the host)."""
    if type(device).__module__.split(".")[0] == "torch":  # torch.device
        device = str(device)
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind == "cpu" and not index:
            return None
        if kind == "cuda" and (not index or index.isdigit()):
            return TORCH_LIB, int(index) if index else int(torch_module().cuda.current_device())
    elif isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return CUPY_LIB, device
    elif type(device).__module__.startswith("cupy") and hasattr(device, "id"):  # cupy.cuda.Device
        return CUPY_LIB, int(device.id)
    raise ValueError(
        f"device must be 'cpu', 'cuda', 'cuda:N', a torch.device, a GPU index or a cupy.cuda.Device, got {device!r}"
    )


def device_of(x: Any) -> int:
    """The GPU an array lives on, or -1 for the host."""
    return _device_of(_kind(x), x)


def upload(x: Any, device: int) -> Any:
    """A host array (NumPy, or any array with DLPack on the CPU) copied to GPU ``device`` as a CuPy
    array, the copy complete on return (its source may change or go at once)."""
    import numpy as np

    cupy = cupy_module()
    with cupy.cuda.Device(device):
        copy = cupy.asarray(np.from_dlpack(x))
        cupy.cuda.get_current_stream().synchronize()
    return copy


def _refuse_traced(name: str) -> None:
    """A JAX tracer (``jax.jit``, ``grad``, ``vmap``) has no memory to hand the kernels, and the
    host path's array-API algorithms branch on values (NaN checks, split counts), which tracing
    cannot do. ``attention`` and ``attention_with_kvcache`` take tracers through ``_jax`` (XLA
    custom calls); the entry points that reach here do not yet: refused with the way out, rather
    than failing somewhere inside."""
    raise TypeError(
        f"{name} is a traced JAX array (jax.jit, grad or vmap): of cupyflash's functions only attention() and "
        "attention_with_kvcache() run inside JAX transformations so far. Call this one on concrete jax.Array inputs "
        "outside the transformation (on a GPU they run the kernels through DLPack)."
    )


def traced(arrays: Sequence[Any]) -> bool:
    """Is any of ``arrays`` a JAX tracer? (Then the call runs as a JAX primitive: ``_jax``.)"""
    for x in arrays:
        if x is not None and (_kind_of_type.get(type(x)) or _kind(x)) == TRACED:
            return True
    return False


def has_jax_arrays(arrays: Sequence[Any]) -> bool:
    """Is any of ``arrays`` a JAX array, traced or concrete? (A cache call that appends to JAX
    arrays, which are immutable, returns the new caches: ``_jax``.)"""
    for x in arrays:
        if x is not None and (_kind(x) == TRACED or _library(x) in ("jax", "jaxlib")):
            return True
    return False


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") or hasattr(x, "__dlpack_device__")


def lean_arrays(arrays: Sequence[Any]) -> tuple[ArrayLib, int, bool] | None:
    """The per-token fast path: (library, device, autograd) when a call's arrays (the first one
    given, None entries skipped) are all CuPy arrays or all PyTorch CUDA tensors on one GPU (a
    few attribute reads), else None for ``gpu_arrays``; autograd as ``ArrayLib.check_inputs``
    says, read in the loop that checks the devices (never for CuPy, whose call to ask cost the
    per-token path ~40 ns). The first array, read before the loop, is passed over in it by
    identity (a slice that left it out cost as much as reading it again)."""
    first = arrays[0]
    cls = type(first)
    kind = _kind_of_type.get(cls) or _kind(first)
    if kind == TORCH:
        device = first.get_device()
        if device < 0:
            return None
        grad = first.requires_grad
        for x in arrays:
            if x is not None and x is not first:
                if (type(x) is not cls and _kind(x) != TORCH) or x.get_device() != device:
                    return None
                grad = grad or x.requires_grad
        # A kernel launch is invisible to autograd (TorchLib.check_inputs): the custom op then.
        return TORCH_LIB, device, grad and bool(torch_module().is_grad_enabled())
    if kind == CUPY:
        device = first.data.device_id
        for x in arrays:
            if x is not None and x is not first:
                if (type(x) is not cls and _kind(x) != CUPY) or x.data.device_id != device:
                    return None
        return CUPY_LIB, device, False
    return None


# ---------------------------------------------------------------------------------------------
# What the kernels can read in place.
# ---------------------------------------------------------------------------------------------
def tile_layout_readable(shape: Sequence[int], strides: Sequence[int], chunk: int = 8) -> bool:
    """Unit stride on head_dim and strides that are 16-byte multiples (cp.async and TMA move
    16-byte chunks of ``chunk`` elements: 8 of 16 bits, 16 of a float8 cache), none negative (a TMA
    tensor map takes unsigned strides). Strides of size-1 axes are never used, so they may be anything."""
    if strides[-1] != 1 and shape[-1] > 1:
        return False
    for size, stride in zip(shape[:-1], strides[:-1]):
        if (stride % chunk or stride < 0) and size > 1:
            return False
    return True


def kernel_readable(ptr: int, shape: Sequence[int], strides: Sequence[int]) -> bool:
    """``tile_layout_readable`` and a 16-byte aligned base pointer."""
    return ptr % 16 == 0 and tile_layout_readable(shape, strides)


@functools.cache
def device_attribute(device: int, name: str) -> int:
    """A CUDA device attribute (MaxSharedMemoryPerBlockOptin, MultiProcessorCount ...), read once
    per device."""
    return int(cupy_module().cuda.Device(device).attributes[name])
