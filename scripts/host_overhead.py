"""Host time per call of the public entry points, with the device stubbed out: no GPU needed.

The arrays are stand-ins that cupyflash takes for CuPy arrays on GPU 0 (shape, dtype, strides,
a pointer), or with ``--torch`` PyTorch CPU tensors that say they are on GPU 0 (``get_device``
patched; torch imported before cupyflash, as a PyTorch program does); the device's description
is an H100's, and ``_launch.run`` returns at once: what is timed is everything a call does on
the host before its launch (option checks, routing, the plan lookup, the operands' binding is
not included). The first call of each shape plans (nothing is compiled); the figure is the
median over repeats of the mean of many calls after it.

    PYTHONPATH=TREE python scripts/host_overhead.py [--torch] [--calls 20000] [--repeats 7]

To compare trees (exports of other commits) on a noisy machine, ``--ab`` runs each tree in its own
process, the order rotating every round, and reports each call's minimum and median over rounds:

    python scripts/host_overhead.py --ab TREE_A TREE_B [--rounds 7] [--calls 5000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

H100 = dict(arch="sm_90a", num_sms=132, max_smem_per_block=232448, smem_per_sm=233472, regs_per_sm=65536,
             max_threads_per_sm=2048, max_blocks_per_sm=32)  # fmt: skip


class _Memory:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.device_id = 0


class _StandIn:
    """The type of the stand-ins: one type, as every CuPy array is a ``cupy.ndarray``."""


_StandIn.__module__ = "cupy._core.core"
_StandIn.__name__ = _StandIn.__qualname__ = "ndarray"


def stand_in(shape: tuple[int, ...], dtype: str) -> object:
    """An object cupyflash reads as a C-contiguous CuPy array on GPU 0."""
    itemsize = np.dtype(dtype).itemsize
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    x: Any = _StandIn()
    x.shape, x.dtype, x.itemsize, x.ndim = shape, np.dtype(dtype), itemsize, len(shape)
    x.strides, x.data, x.device = tuple(reversed(strides)), _Memory(1 << 20), 0
    return x


def torch_stand_in(shape: tuple[int, ...], dtype: str) -> Any:
    """A PyTorch CPU tensor that cupyflash reads as a CUDA tensor on GPU 0 (``_stub_torch``): its
    shape, dtype and requires_grad are read in C as a CUDA tensor's are."""
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype))


def _stub_torch() -> None:
    """Every tensor says it is on GPU 0 (a Python method here; a C one on a real tensor)."""
    import torch

    torch.Tensor.get_device = lambda self: 0  # type: ignore[method-assign]


def _stub_device() -> None:
    """The device's description without a driver, and no launch."""
    from cupyflash import _interop, _launch

    for name in ("_device", "_plan"):
        module = sys.modules.get(f"cupyflash.{name}") or __import__(f"cupyflash.{name}", fromlist=["_"])
        if hasattr(module, "DeviceInfo") and hasattr(module, "device_info"):
            info = module.DeviceInfo(index=0, **H100)
            module.device_info = lambda index, info=info: info
    _launch.run = lambda *args, **kwargs: (None, None)
    _launch.run_outputs = lambda launch, *args, **kwargs: tuple(None for _ in launch.outputs)
    _interop.current_device = lambda: 0
    from cupyflash import _cascade

    _cascade.device_ints = lambda like, values: stand_in(np.shape(values), "int32")


def _time(call: Callable[[], object], calls: int, repeats: int) -> float:
    call()  # plans
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means) * 1e6


def _cases(torch: bool) -> dict[str, Callable[[], object]]:
    """The calls timed: CuPy stand-ins, or with ``torch`` the tensor ones of a PyTorch program."""
    import cupyflash

    make = torch_stand_in if torch else stand_in
    q = make((1, 1024, 16, 128), "float16")
    k = v = make((1, 1024, 16, 128), "float16")
    q1 = make((8, 1, 32, 128), "float16")
    cache = make((8, 4096, 8, 128), "float16")
    if torch:
        return {
            "attention, prefill, torch": lambda: cupyflash.attention(q, k, v, causal=True),
            "attention, one query token, torch": lambda: cupyflash.attention(q1, cache, cache),
            "attention_with_kvcache, decode, torch": lambda: cupyflash.attention_with_kvcache(
                q1, cache, cache, cache_seqlens=4000
            ),
        }
    packed = stand_in((1024, 16, 128), "float16")
    cu = stand_in((3,), "int32")
    new = stand_in((8, 1, 8, 128), "float16")
    seqlens = stand_in((8,), "int32")
    lse = stand_in((1, 16, 1024), "float32")
    # 64 requests over a 32k prefix of 16-token pages, 512 keys of their own each
    q64 = stand_in((64, 1, 32, 128), "float16")
    pool = stand_in((2048 + 64 * 33, 16, 8, 128), "float16")
    prefix_table = stand_in((1, 2048), "int32")
    own_table, flat_table = stand_in((64, 33), "int32"), stand_in((64, 2048 + 33), "int32")
    seqlens64 = stand_in((64,), "int32")
    return {
        "attention, prefill (1, 1k, 16, 128)": lambda: cupyflash.attention(q, k, v, causal=True),
        "attention, one query token over 4k keys": lambda: cupyflash.attention(q1, cache, cache),
        "attention_with_kvcache, decode (8 x 4k)": lambda: cupyflash.attention_with_kvcache(
            q1, cache, cache, cache_seqlens=4000
        ),
        "attention_with_kvcache, decode step appending": lambda: cupyflash.attention_with_kvcache(
            q1, cache, cache, cache_seqlens=seqlens, k_new=new, v_new=new
        ),
        "attention_with_kvcache, flat (64 x 32.5k)": lambda: cupyflash.attention_with_kvcache(
            q64, pool, pool, cache_seqlens=seqlens64, block_table=flat_table
        ),
        "attention_with_shared_prefix (64 x 32k+512)": lambda: cupyflash.attention_with_shared_prefix(
            q64,
            pool,
            pool,
            prefix_block_table=prefix_table,
            prefix_seqlens=32768,
            block_table=own_table,
            cache_seqlens=seqlens64,
        ),
        "attention_varlen (2 sequences, 1k rows)": lambda: cupyflash.attention_varlen(
            packed, packed, packed, cu, cu, 512, 512, causal=True
        ),
        "attention_backward, prefill (1, 1k, 16, 128)": lambda: cupyflash.attention_backward(
            q, q, k, v, q, lse, causal=True
        ),
    }


def measure(torch: bool, calls: int, repeats: int) -> tuple[dict[str, float], dict[str, str]]:
    """Microseconds per call of each case, in this process (the tree on ``sys.path``), and the
    error of each case the tree could not run (an older tree without that entry point or option;
    a path the stand-ins cannot take), by name."""
    if torch:
        _stub_torch()
    _stub_device()
    times, errors = {}, {}
    for name, call in _cases(torch).items():
        try:
            times[name] = _time(call, calls, repeats)
        except Exception as e:  # noqa: BLE001  (named in the report, not hidden)
            errors[name] = f"{type(e).__name__}: {e}"
    return times, errors


def compare(trees: list[str], rounds: int, calls: int, repeats: int) -> None:
    """Each tree in its own process, CuPy then torch, the order rotating every round."""
    results: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    errors: dict[tuple[str, str], str] = {}
    for r in range(rounds):
        for i in range(len(trees)):
            tree = trees[(r + i) % len(trees)]
            for torch in (False, True):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                argv = [sys.executable, __file__, "--json", f"--calls={calls}", f"--repeats={repeats}"]
                out = subprocess.run(argv + ["--torch"] * torch, env=env, check=True, capture_output=True, text=True)
                times, failed = json.loads(out.stdout)
                for name, us in times.items():
                    results[tree].setdefault(name, []).append(us)
                errors.update({(tree, name): error for name, error in failed.items()})
    names = list(dict.fromkeys([*(n for t in trees for n in results[t]), *(n for _, n in errors)]))
    print(f"{rounds} rounds, us per call: minimum / median over rounds")
    print(f"{'call':45s}" + "".join(f" {os.path.basename(os.path.abspath(t))[:19]:>19s}" for t in trees))
    for name in names:
        cells = [results[t].get(name) for t in trees]
        print(f"{name:45s}" + "".join(
            f" {min(c):8.2f} / {statistics.median(c):6.2f}" if c else f" {'-':>19s}" for c in cells
        ))  # fmt: skip
    for (tree, name), error in errors.items():
        print(f"not run: {name} on {tree}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch", action="store_true", help="PyTorch tensors (torch imported first)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--ab", nargs="+", metavar="TREE", help="compare these trees, each in its own process")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.ab:
        compare(args.ab, args.rounds, args.calls, args.repeats)
        return
    if args.torch:
        import torch  # noqa: F401  (before cupyflash, which then registers its custom ops)
    import cupyflash

    times, errors = measure(args.torch, args.calls, args.repeats)
    if args.json:
        print(json.dumps([times, errors]))
        return
    print(f"cupyflash from {cupyflash.__file__}")
    for name, us in times.items():
        print(f"{name:45s} {us:7.2f} us")
    for name, error in errors.items():
        print(f"not run: {name}: {error}")


if __name__ == "__main__":
    main()
