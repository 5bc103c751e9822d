"""The front door: the one route every forward entry point's call takes, written once.

A public function checks its options, builds its call (``_attention.Forward``,
``_kvcache.CacheCall`` ...) and hands it here with its ``Operation``, which names the executors
and the framework adapters of that entry point. The route, in order:

1. torch.compile tracing the call: the PyTorch custom op (Dynamo keeps it in its graph as one
   opaque op), or a refusal where the entry point has none;
2. CuPy arrays or CUDA tensors on one GPU (a few attribute reads: the per-token path);
3. JAX tracers (``jax.jit``, ``grad``, ``vmap``): the XLA custom call, where the entry point has
   one (else ``_interop.gpu_arrays`` refuses them, naming the way out); concrete JAX arrays too
   for a call that writes into its arrays (JAX arrays are immutable: the custom call returns
   the written ones, new);
4. any other arrays: their library and device found once (``_interop.gpu_arrays``), host arrays
   to the array-API algorithms;
5. PyTorch tensors that require grad, any of the call's: the custom op where it has a backward
   (which refuses what gets no gradient), else a refusal: never a detached result;
6. the GPU executor.

A call has ``names`` and ``arrays()`` (its arrays in that order, None for one not given),
``prepared()`` (the checks that come after the torch.compile and JAX routes: a call that needs
none is itself), ``on(arrays)`` (the same call on adopted arrays) and ``writes`` (whether it
writes into its arrays).

The adapters (``_torch_ops``, ``_jax``) are imported here on first use, so importing cupyflash
imports neither torch nor jax; they call the executors, never the public functions.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _interop


@dataclass(frozen=True, slots=True)
class Operation:
    """What the route needs of one forward entry point."""

    name: str  # the public function, for messages
    host: Callable[[Any], tuple[Any, Any]]  # the array-API algorithms: call -> (out, lse)
    gpu: Callable[[_interop.ArrayLib, int, Any, bool], tuple[Any, Any]]  # the kernels
    torch: str | None = None  # the _torch_ops function taking the call through its custom op
    jax: str | None = None  # the _jax function staging the call as an XLA custom call
    backward: bool = True  # the custom op has a backward (else tensors that require grad are refused)


def route(op: Operation, call: Any, want_lse: bool) -> tuple[Any, ...]:
    """``call`` by the route above: (out, lse), lse None on the GPU unless wanted; for a call that
    writes into JAX arrays, (out, lse, *written): the written arrays, new."""
    if _interop.compiling():  # before anything Dynamo would have to trace
        return _compile_route(op, call, want_lse)
    if getattr(call, "captured_grad", False):  # q, k and v may not require grad: the functions' arrays do
        return _autograd_route(op, call.prepared(), want_lse)
    arrays = call.arrays()
    found = _interop.lean_arrays(arrays)
    if found is not None:
        lib, device, autograd = found
        if not autograd:
            return op.gpu(lib, device, call.prepared(), want_lse)
    else:
        if op.jax is not None and (_interop.traced(arrays) or (call.writes and _interop.has_jax_arrays(arrays))):
            return getattr(jax_ops(), op.jax)(call, want_lse)
        call = call.prepared()
        on_gpu = _interop.gpu_arrays(call.names, call.arrays())
        if on_gpu is None:
            if _interop.needs_autograd(arrays):
                return _autograd_route(op, call, want_lse)
            return op.host(call)
        lib, device, adopted = on_gpu
        call = call.on(adopted)
        if not lib.check_inputs(arrays):
            return op.gpu(lib, device, call, want_lse)
    return _autograd_route(op, call.prepared(), want_lse)  # tensors that require grad


def captured_grad(mods: tuple[Any, Any]) -> bool:
    """Whether a tensor that a traced score_mod / mask_mod (``_mods.Mod``) captures requires grad
    (with grad mode on): autograd must see the call even where q, k and v do not require grad.
    False while Dynamo traces (the compiled route refuses such a tensor by name)."""
    if _interop.compiling():
        return False
    captured = [x for mod in mods if mod is not None for x in mod.buffers if hasattr(x, "requires_grad")]
    return bool(captured) and _interop.needs_autograd(captured)


def compiling() -> bool:
    """Whether Dynamo traces the call (torch.compile): then route takes the custom op's way."""
    return _interop.compiling()


def _compile_route(op: Operation, call: Any, want_lse: bool) -> tuple[Any, ...]:
    if op.torch is None:
        raise NotImplementedError(f"{op.name} does not run under torch.compile yet")
    return getattr(torch_ops(), op.torch)(call, want_lse)


def _autograd_route(op: Operation, call: Any, want_lse: bool) -> tuple[Any, ...]:
    if op.torch is None or not op.backward:
        _interop.refuse_autograd(op.name)
    return getattr(torch_ops(), op.torch)(call, want_lse)


@functools.cache
def torch_ops() -> Any:
    """``_torch_ops``: the PyTorch custom ops (registered with torch on import)."""
    from . import _torch_ops

    return _torch_ops


@functools.cache
def jax_ops() -> Any:
    """``_jax``: the XLA custom calls, imported on the first traced call (importing cupyflash
    never imports jax)."""
    from . import _jax

    return _jax


# The PyTorch custom ops exist before any call is traced: now if torch is imported, else once
# cupyflash first meets a tensor.
_interop.when_torch_imported(torch_ops)
if "torch" in sys.modules:
    torch_ops()
