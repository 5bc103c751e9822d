"""Benchmark harness: cupyflash beside PyTorch SDPA (flash and cuDNN backends) and
FlashAttention-4 (where installed) in one process, on the same inputs, timed with CUDA events
(median after warm-up), never on zeros.

Used by ``python -m cupyflash bench``, scripts/gpu_check.sh and the asv suite. FLOPs follow
DESIGN.md: forward ``4 * B * H * Nq * Nk * d``, halved for causal.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# The prefill shapes of the FA2 target: H * d = 2048, B * N = 16384.
PREFILL_HEAD_DIMS = (64, 128)
PREFILL_SEQLENS = (1024, 4096, 16384)


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str

    @property
    def flops(self) -> float:
        full = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        return full / 2 if self.causal else full


def prefill_shapes(
    dtypes: tuple[str, ...] = ("bfloat16", "float16"), head_dims: tuple[int, ...] = PREFILL_HEAD_DIMS
) -> list[PrefillShape]:
    """16k tokens per batch, 2048 / d heads (model width 2048), each length and causal or not."""
    return [
        PrefillShape(16384 // n, n, 2048 // d, d, causal, dtype)
        for dtype in dtypes
        for d in head_dims
        for n in PREFILL_SEQLENS
        for causal in (False, True)
    ]


def cuda_times_ms(
    fns: dict[str, Callable[[], Any]], *, warmup_ms: float = 300.0, repeat: int = 30, calls: int = 1
) -> dict[str, float]:
    """Median milliseconds of each function between CUDA events on PyTorch's current stream,
    after at least ``warmup_ms`` of warm-up (clocks ramp up; first calls compile or load kernels).

    The samples are interleaved -- one of each function per round, in a shuffled order -- so the
    GPU's clock and temperature drift fall on every function alike, and their ratios hold still
    where their absolute times move (short kernels at N = 1024 moved 10% between processes). The
    order is shuffled, not rotated: rotating keeps each function behind the same neighbour, and a
    kernel that follows a high-power one (wgmma) may inherit its lower clocks. Even shuffled, a
    low-power kernel (mma.sync: the FA2 kernel, PyTorch's flash backend) may measure lower here
    than alone after its own warm-up: flash at d = 128, N = 16384 gave 324 TFLOP/s in the first
    interleaved run (rotating) against 340 and 341 timed in blocks the same day, on another host
    (docs/evidence.md: 2026-11-30-1661eae, 2026-11-30-504d286).

    With ``calls`` > 1 a sample is that many back-to-back calls between one pair of events,
    divided by ``calls``: the per-call time of a stream of calls, where each call's host work
    overlaps the GPU work of the one before (as in a generation loop); with 1 call the host
    time before the first launch is inside the sample."""
    import torch

    def stamp() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(begin: Any, end: Any) -> float:
        end.synchronize()
        return float(begin.elapsed_time(end))

    return _interleaved_ms(fns, torch.cuda.synchronize, stamp, elapsed_ms, warmup_ms, repeat, calls)


def host_times_ms(
    fns: dict[str, Callable[[], Any]], *, warmup_ms: float = 300.0, repeat: int = 30, calls: int = 1
) -> dict[str, float]:
    """:func:`cuda_times_ms`'s rounds timed with the host clock, for work that runs on the host
    (the CPU path, where there is no device to wait for)."""
    return _interleaved_ms(
        fns, lambda: None, time.perf_counter, lambda begin, end: (end - begin) * 1e3, warmup_ms, repeat, calls
    )


def _interleaved_ms(
    fns: dict[str, Callable[[], Any]],
    sync: Callable[[], None],
    stamp: Callable[[], Any],
    elapsed_ms: Callable[[Any, Any], float],
    warmup_ms: float,
    repeat: int,
    calls: int,
) -> dict[str, float]:
    """The warm-up and the shuffled rounds of :func:`cuda_times_ms`, on any clock: ``stamp``
    marks a point of the work queue, ``elapsed_ms`` waits for the later mark and measures."""
    names = list(fns)
    for fn in fns.values():
        fn()
    sync()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warmup_ms:
        for fn in fns.values():
            fn()
            sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(repeat):
        order.shuffle(names)
        for name in names:
            begin = stamp()
            for _ in range(calls):
                fns[name]()
            times[name].append(elapsed_ms(begin, stamp()) / calls)
    return {name: float(statistics.median(samples)) for name, samples in times.items()}


def cuda_time_ms(fn: Callable[[], Any], *, warmup_ms: float = 300.0, repeat: int = 30, calls: int = 1) -> float:
    """:func:`cuda_times_ms` of one function."""
    return cuda_times_ms({"fn": fn}, warmup_ms=warmup_ms, repeat=repeat, calls=calls)["fn"]


#: The timings a speed claim must hold under, in the order :func:`three_timings_ms` runs them.
TIMINGS = ("single", "back_to_back", "interleaved")
#: Calls per sample of the back-to-back timing.
BACK_TO_BACK_CALLS = 20


def check_timings(timings: tuple[str, ...]) -> None:
    """Refuse an empty or unknown set of timing names (before anything compiles)."""
    unknown = [t for t in timings if t not in TIMINGS]
    if not timings or unknown:
        raise ValueError(f"timings must be some of {TIMINGS}, got {tuple(timings)}")


def three_timings_ms(
    fns: dict[str, Callable[[], Any]],
    *,
    repeat: int = 30,
    warmup_ms: float = 300.0,
    timings: tuple[str, ...] = TIMINGS,
    times_ms: Callable[..., dict[str, float]] | None = None,
) -> dict[str, dict[str, float]]:
    """Median milliseconds per call of each function under each of ``timings``, by timing:

    * ``single``: each function alone after its own warm-up, one call between two events
      (:func:`cuda_time_ms`): the kernel at the clocks it brings about itself, with the host
      time before its launch inside the sample;
    * ``back_to_back``: each function alone, :data:`BACK_TO_BACK_CALLS` calls between two events
      divided by that count, a third of ``repeat`` samples (at least 3): a stream of calls,
      each call's host work hidden behind the GPU work of the one before;
    * ``interleaved``: :func:`cuda_times_ms`'s shuffled rounds, one call of each function in
      turn, so that clock drift falls on all of them alike.

    They disagree for a reason: the GPU is power-limited, and a kernel that follows a low-power
    one inherits the higher clocks it left (interleaved), where alone it runs at the clocks of
    its own power draw (single, back-to-back). A ratio of two functions is a speed claim where it holds under all three
    (DESIGN.md, Benchmarks). ``times_ms``: the rounds timer, :func:`cuda_times_ms` unless given
    (:func:`host_times_ms` for work on the host)."""
    check_timings(timings)
    times_ms = times_ms or cuda_times_ms
    alone = {"single": (repeat, 1), "back_to_back": (max(3, repeat // 3), BACK_TO_BACK_CALLS)}
    result: dict[str, dict[str, float]] = {}
    for timing in timings:
        if timing == "interleaved":
            result[timing] = times_ms(fns, warmup_ms=warmup_ms, repeat=repeat)
            continue
        samples, calls = alone[timing]
        result[timing] = {}
        for name, fn in fns.items():  # each alone: its own warm-up, then its samples
            result[timing] |= times_ms({name: fn}, warmup_ms=warmup_ms, repeat=samples, calls=calls)
    return result


def record_timings(row: dict[str, Any], times_ms: dict[str, dict[str, float]], flops: Callable[[str], float]) -> None:
    """:func:`three_timings_ms`'s result into ``row`` as TFLOP/s (``flops(name)``: the work of
    one call): ``row["timings"][timing][name]`` for each timing; ``row[name]`` and
    ``row[f"{name}_ms"]`` from the interleaved timing, or, where it was not run, from the first
    timing run; ``row["timing"]`` names the one they come from."""
    headline = "interleaved" if "interleaved" in times_ms else next(iter(times_ms))
    tflops = {
        timing: {name: round(flops(name) / ms / 1e9, 1) for name, ms in by_name.items()}
        for timing, by_name in times_ms.items()
    }
    for name, ms in times_ms[headline].items():
        row[name] = tflops[headline][name]
        row[f"{name}_ms"] = round(ms, 4)
    row["timing"] = headline
    row["timings"] = tflops


def runnable(calls: dict[str, Callable[[], Any]], row: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The calls that run; each one that raises (a backend refusing the inputs) gets ``None``
    and its first error line in ``row``."""
    ok = {}
    for name, call in calls.items():
        try:
            call()
        except (RuntimeError, ValueError, TypeError) as error:
            row[name] = None
            row[f"{name}_error"] = str(error).splitlines()[0][:200]
            continue
        ok[name] = call
    return ok


def prefill_inputs(shape: PrefillShape, seed: int = 0) -> tuple[Any, Any, Any]:
    """Random q, k, v in ``bshd`` (B, N, H, d), torch CUDA tensors."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    return tuple(torch.randn(dims, generator=gen, device="cuda", dtype=dtype) for _ in range(3))  # type: ignore[return-value]


def sdpa_call(backend: str, q: Any, k: Any, v: Any, causal: bool, dropout_p: float = 0.0) -> Callable[[], Any]:
    """PyTorch SDPA forced to one backend ("flash" or "cudnn"), on bhsd views of bshd data."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def call() -> Any:
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, dropout_p=dropout_p)

    return call


#: FlashAttention-4: the ``flash_attn.cute`` package of flash-attn-4 (CuTe-DSL kernels compiled
#: at the first call of a shape), a peer where it is installed. Never cupyflash's drop-in
#: ``cupyflash.flash_attn``, which ``cupyflash.flash_attn.install()`` registers as ``flash_attn``.
FA4_MODULE = "flash_attn.cute"
FA4_MISSING = f"{FA4_MODULE} is not installed"
SDPA_BACKENDS = ("flash", "cudnn")
#: The other libraries' entries: PyTorch SDPA's backends and FlashAttention-4.
PEERS = (*SDPA_BACKENDS, "fa4")


def _inside_cupyflash(module_name: str | None, file: str | None) -> bool:
    """Whether a module (its name, its file) is cupyflash's: named ``cupyflash.*``, or a file
    inside the cupyflash package that is imported (a copy re-exported under another name)."""
    if module_name and module_name.split(".")[0] == "cupyflash":
        return True
    spec = importlib.util.find_spec("cupyflash")
    if not file or spec is None:
        return False
    real = os.path.realpath(file)
    for root in spec.submodule_search_locations or ():
        top = os.path.realpath(root)
        if os.path.commonpath([real, top]) == top:
            return True
    return False


def fa4_attention() -> Callable[..., Any]:
    """FlashAttention-4's ``flash_attn_func`` (imported at the first call, not at import time).

    Raises ImportError (:data:`FA4_MISSING`) where flash-attn-4 is not installed, and
    RuntimeError where ``flash_attn`` or ``flash_attn.cute`` resolves into cupyflash
    (``cupyflash.flash_attn.install()`` was called, or a module re-exports cupyflash's
    functions): the peer would be cupyflash timed against itself."""
    parent = sys.modules.get("flash_attn")
    if parent is not None and _inside_cupyflash(getattr(parent, "__name__", None), getattr(parent, "__file__", None)):
        raise RuntimeError(
            f"flash_attn is {parent.__name__} (cupyflash.flash_attn.install() registered it), so {FA4_MODULE} "
            "would not be FlashAttention-4; call cupyflash.flash_attn.uninstall() before timing the fa4 peer"
        )
    try:
        module = importlib.import_module(FA4_MODULE)
    except ModuleNotFoundError as error:
        if error.name in ("flash_attn", FA4_MODULE):
            raise ImportError(FA4_MISSING) from error
        raise ImportError(f"{FA4_MODULE} is not importable: {error}") from error
    except (ImportError, OSError) as error:  # installed, but a library of its own is missing
        raise ImportError(f"{FA4_MODULE} is not importable: {type(error).__name__}: {error}") from error
    function = getattr(module, "flash_attn_func", None)
    if function is None:
        raise ImportError(f"{FA4_MODULE} ({getattr(module, '__file__', None)}) has no flash_attn_func")
    code = getattr(function, "__code__", None)
    for name, file in (
        (module.__name__, getattr(module, "__file__", None)),
        (getattr(function, "__module__", None), getattr(code, "co_filename", None)),
    ):
        if _inside_cupyflash(name, file):
            raise RuntimeError(
                f"{FA4_MODULE} resolves into cupyflash ({name}, {file}): the fa4 peer would time cupyflash itself"
            )
    return function


def _refusal(reason: str) -> Callable[[], Any]:
    """A call that raises ``reason`` (RuntimeError): :func:`runnable` records it in the row."""

    def call() -> Any:
        raise RuntimeError(reason)

    return call


def fa4_call(q: Any, k: Any, v: Any, causal: bool, dropout_p: float = 0.0) -> Callable[[], Any]:
    """FlashAttention-4's forward on bshd tensors, its output (the LSE it returns beside it
    dropped), scale 1/sqrt(d) as cupyflash's. Where it cannot run -- not installed, resolving into
    cupyflash, dropout asked for (it has none) -- a call that raises RuntimeError with the reason."""
    try:
        function = fa4_attention()
    except (ImportError, RuntimeError) as error:
        return _refusal(str(error))
    if dropout_p:
        return _refusal(f"{FA4_MODULE} has no dropout")
    scale = q.shape[-1] ** -0.5

    def call() -> Any:
        try:
            out = function(q, k, v, causal=causal, softmax_scale=scale)
        except (AssertionError, NotImplementedError) as error:  # how its interface refuses inputs
            raise RuntimeError(f"{FA4_MODULE} refused the inputs: {type(error).__name__}: {error}") from error
        return out[0] if isinstance(out, tuple) else out

    return call


def peer_call(backend: str, q: Any, k: Any, v: Any, causal: bool, dropout_p: float = 0.0) -> Callable[[], Any]:
    """The forward of one peer (:data:`PEERS`) on bshd tensors; its output is bhsd for SDPA's
    backends, bshd for FlashAttention-4."""
    if backend == "fa4":
        return fa4_call(q, k, v, causal, dropout_p)
    if backend in SDPA_BACKENDS:
        return sdpa_call(backend, q, k, v, causal, dropout_p)
    raise ValueError(f"unknown backend {backend!r}: cupyflash's are {sorted(CUPYFLASH_BACKENDS)}, peers {PEERS}")


#: cupyflash's own entries: the default dispatch (on Hopper the wgmma kernel) and each kernel forced.
CUPYFLASH_BACKENDS = {
    "cupyflash": "auto",
    "cupyflash_fa2": "fa2",
    "cupyflash_fa3": "fa3",
    "cupyflash_fa1": "fa1",
    "cupyflash_naive": "naive",
}
PREFILL_BACKENDS = ("cupyflash", "cupyflash_fa2", "flash", "cudnn", "fa4")


def run_prefill(
    shape: PrefillShape, backends: tuple[str, ...] = PREFILL_BACKENDS, timings: tuple[str, ...] = TIMINGS
) -> dict[str, Any]:
    """TFLOP/s of each backend on one shape under each of ``timings`` (:func:`three_timings_ms`,
    recorded by :func:`record_timings`: ``row[backend]`` is the interleaved timing's, or the
    first one's where it was not run). A backend that refused the inputs, or a peer that is not
    installed, gets ``None`` and its reason in ``row[f"{backend}_error"]``."""
    import cupyflash

    check_timings(timings)
    q, k, v = prefill_inputs(shape)
    row: dict[str, Any] = asdict(shape)
    calls: dict[str, Callable[[], Any]] = {}
    for backend in backends:
        if backend in CUPYFLASH_BACKENDS:
            algorithm = CUPYFLASH_BACKENDS[backend]
            calls[backend] = functools.partial(cupyflash.attention, q, k, v, causal=shape.causal, algorithm=algorithm)
        else:
            calls[backend] = peer_call(backend, q, k, v, shape.causal)
    record_timings(row, three_timings_ms(runnable(calls, row), timings=timings), lambda _: shape.flops)
    return row


# ---------------------------------------------------------------------------------------------
# Training: forward + backward (the backward counted as 2.5x the forward's FLOPs).
# ---------------------------------------------------------------------------------------------
BACKWARD_FLOP_FACTOR = 2.5
TRAINING_BACKENDS = ("cupyflash", "cupyflash_det", "flash", "cudnn", "fa4")


def alibi_slopes(heads: int, device: Any = "cuda") -> Any:
    """ALiBi's standard slopes 2^(-8 i / H), i = 1 .. H: a float32 torch tensor on ``device``."""
    import torch

    return torch.exp2(-torch.arange(1, heads + 1, device=device, dtype=torch.float32) * (8 / heads))


def _training_call(backend: str, q: Any, k: Any, v: Any, causal: bool, dropout_p: float) -> Callable[[], Any]:
    """The forward of one backend on leaves that require grad (autograd records it);
    "cupyflash_det": cupyflash with ``deterministic=True`` (its backward without atomics);
    "cupyflash_alibi": cupyflash with ALiBi (``alibi_slopes``, the standard slopes: what ALiBi
    costs beside the same call without it)."""
    import cupyflash

    if backend == "cupyflash_det":
        return functools.partial(cupyflash.attention, q, k, v, causal=causal, deterministic=True, dropout_p=dropout_p)
    if backend == "cupyflash_alibi":
        slopes = alibi_slopes(q.shape[2], q.device)
        return functools.partial(cupyflash.attention, q, k, v, causal=causal, alibi_slopes=slopes, dropout_p=dropout_p)
    if backend in CUPYFLASH_BACKENDS:
        algorithm = CUPYFLASH_BACKENDS[backend]
        return functools.partial(cupyflash.attention, q, k, v, causal=causal, algorithm=algorithm, dropout_p=dropout_p)
    return peer_call(backend, q, k, v, causal, dropout_p)


def extra_mib(call: Callable[[], Any]) -> float:
    """MiB that one call allocates at its peak beyond what was allocated before it (PyTorch's
    CUDA allocator)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def run_training(
    shape: PrefillShape,
    backends: tuple[str, ...] = TRAINING_BACKENDS,
    dropout_p: float = 0.0,
    timings: tuple[str, ...] = TIMINGS,
) -> dict[str, Any]:
    """Per backend: TFLOP/s of forward + backward and of the backward alone (autograd.grad on a
    retained graph, entry ``f"{backend}_bwd"``) under each of ``timings``, recorded as by
    :func:`run_prefill`, and the peak memory one forward + backward allocates beyond its inputs
    and output gradient (MiB; O(N) for a flash kernel). ``dropout_p``: every backend drops out
    probabilities (its own generator); FlashAttention-4, which has no dropout, is then refused."""
    import torch

    check_timings(timings)
    q, k, v = (x.requires_grad_(True) for x in prefill_inputs(shape))
    dout = torch.randn_like(q)
    row: dict[str, Any] = {**asdict(shape), "dropout_p": dropout_p}
    forwards = {b: _training_call(b, q, k, v, shape.causal, dropout_p) for b in backends}
    steps, grads = {}, {}
    for backend, forward in runnable(forwards, row).items():
        sdpa = backend in SDPA_BACKENDS  # bhsd output; cupyflash's and FlashAttention-4's are bshd
        out = forward().transpose(1, 2) if sdpa else forward()

        def step(forward: Callable[[], Any] = forward, sdpa: bool = sdpa) -> Any:
            o = forward()
            return torch.autograd.grad(o.transpose(1, 2) if sdpa else o, (q, k, v), dout)

        def grad_only(out: Any = out) -> Any:
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        steps[backend], grads[f"{backend}_bwd"] = step, grad_only
        row[f"{backend}_extra_mib"] = extra_mib(step)

    def flops(name: str) -> float:
        return shape.flops * (BACKWARD_FLOP_FACTOR if name.endswith("_bwd") else 1 + BACKWARD_FLOP_FACTOR)

    record_timings(row, three_timings_ms({**steps, **grads}, repeat=20, timings=timings), flops)
    return row


def ratio_range(row: dict[str, Any], key: str, over: str) -> str:
    """``row[key] / row[over]`` (TFLOP/s) under each timing of the row (``row["timings"]``), as
    its range over them (``0.67-0.72x``; one value where they agree to two decimals): a claim
    holds where the whole range does. A row without timings gives its one ratio; "n/a" where
    either entry is missing."""
    by_timing = row.get("timings") or {"": row}
    ratios = [t[key] / t[over] for t in by_timing.values() if t.get(key) and t.get(over)]
    if not ratios:
        return "n/a"
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


#: Width of a ratio column of the tables: "0.67-0.72x" and a space.
RATIO_WIDTH = 11


def format_training_table(rows: list[dict[str, Any]]) -> str:
    """One line per shape: forward + backward TFLOP/s of each backend (``row[backend]``: the
    interleaved timing where it was run), cupyflash's ratios to PyTorch flash, cuDNN and
    FlashAttention-4 and the deterministic mode's to the default (each as its range over the
    row's timings), the backward's TFLOP/s and the extra memory of one step."""

    def value(r: dict[str, Any], key: str) -> float:
        return float(r.get(key) or float("nan"))

    w = RATIO_WIDTH
    peers = ("flash", "cudnn", "fa4")
    lines = [
        f"{'dtype':9} {'d':>4} {'N':>6} {'causal':>6} | {'fwd+bwd':7} {'ours':>6} {'det':>6} {'flash':>6} "
        f"{'cudnn':>6} {'fa4':>6} | {'vs flash':>{w}} {'vs cudnn':>{w}} {'vs fa4':>{w}} {'det/ours':>{w}} | "
        f"bwd {'ours':>6} {'flash':>6} {'cudnn':>6} {'fa4':>6} | extra MiB ours/flash/cudnn/fa4"
    ]
    for r in rows:
        ratios = [ratio_range(r, "cupyflash", peer) for peer in peers] + [ratio_range(r, "cupyflash_det", "cupyflash")]
        tflops = " ".join(f"{value(r, key):>6.1f}" for key in ("cupyflash", "cupyflash_det", *peers))
        bwd = " ".join(f"{value(r, f'{key}_bwd'):>6.1f}" for key in ("cupyflash", *peers))
        mib = "/".join(str(r.get(f"{key}_extra_mib")) for key in ("cupyflash", *peers))
        lines.append(
            f"{r['dtype']:9} {r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} | {'':7} {tflops} | "
            + " ".join(f"{cell:>{w}}" for cell in ratios)
            + f" | {'':3} {bwd} | {mib}"
        )
    return "\n".join(lines)


def _tiny_inputs(kind: str) -> tuple[Any, Any, Any, Callable[[], None]]:
    """1 query, 128 keys, 8 heads, d = 128, bf16 (torch) or fp16 (CuPy), and a device sync."""
    if kind == "cupy":
        import cupy

        rng = cupy.random.default_rng(0)
        q, k, v = (
            rng.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)
            for s in ((1, 1, 8, 128), (1, 128, 8, 128), (1, 128, 8, 128))
        )
        return q, k, v, cupy.cuda.Device().synchronize
    import torch

    q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k), torch.cuda.synchronize


def _median_call_us(call: Callable[[], Any], sync: Callable[[], None], calls: int) -> float:
    samples = []
    for i in range(calls):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
        if i % 100 == 99:
            sync()  # keep the launch queue short: measure the host, not a full queue
    sync()
    return statistics.median(samples) * 1e6


def host_overhead_us(*, rounds: int = 5, calls: int = 1000) -> dict[str, float]:
    """Host time of one tiny call: cupyflash with torch tensors, with CuPy arrays, and PyTorch
    SDPA on the same tensors. The three are interleaved over several rounds and each keeps its
    fastest round's median, so that a slow spell of the host CPU (seen on the H200 machine:
    SDPA 13.5 us in one run, 23.8 us in another) does not fall on one of them only."""
    import torch

    import cupyflash

    tq, tk, tv, tsync = _tiny_inputs("torch")
    cq, ck, cv, csync = _tiny_inputs("cupy")
    sq, sk, sv = (x.transpose(1, 2) for x in (tq, tk, tv))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls_by_name = {
        "cupyflash_torch_us": (lambda: cupyflash.attention(tq, tk, tv, causal=True), tsync),
        "cupyflash_cupy_us": (lambda: cupyflash.attention(cq, ck, cv, causal=True), csync),
        "sdpa_us": (lambda: sdpa(sq, sk, sv), tsync),
    }
    best = {name: float("inf") for name in calls_by_name}
    for call, sync in calls_by_name.values():
        _median_call_us(call, sync, 100)  # warm-up: compile, caches
    for _ in range(rounds):
        for name, (call, sync) in calls_by_name.items():
            best[name] = min(best[name], _median_call_us(call, sync, calls))
    return {name: round(us, 2) for name, us in best.items()}


def format_prefill_table(rows: list[dict[str, Any]]) -> str:
    """One line per shape: TFLOP/s per backend (``row[backend]``: the interleaved timing where it
    was run), the ratios of cupyflash (default dispatch) to PyTorch's flash backend, cuDNN and
    FlashAttention-4, and of its FA2 kernel to flash, each as its range over the row's timings."""

    def value(r: dict[str, Any], key: str) -> float:
        return float(r.get(key) or float("nan"))

    w = RATIO_WIDTH
    header = f"{'dtype':9} {'d':>4} {'N':>6} {'B':>3} {'H':>3} {'causal':>6} | "
    lines = [
        header + f"{'cupyflash':>9} {'fa2':>7} {'flash':>7} {'cudnn':>7} {'fa4':>7} | "
        f"{'vs flash':>{w}} {'vs cudnn':>{w}} {'vs fa4':>{w}} {'fa2/flash':>{w}}"
    ]
    for r in rows:
        ratios = [ratio_range(r, "cupyflash", peer) for peer in ("flash", "cudnn", "fa4")]
        ratios.append(ratio_range(r, "cupyflash_fa2", "flash"))
        lines.append(
            f"{r['dtype']:9} {r['head_dim']:>4} {r['seqlen']:>6} {r['batch']:>3} {r['heads']:>3} "
            f"{str(r['causal']):>6} | {value(r, 'cupyflash'):>9.1f} "
            + " ".join(f"{value(r, key):>7.1f}" for key in ("cupyflash_fa2", "flash", "cudnn", "fa4"))
            + " | "
            + " ".join(f"{cell:>{w}}" for cell in ratios)
        )
    return "\n".join(lines)


def format_refusals(rows: list[dict[str, Any]]) -> list[str]:
    """Each backend's reasons for the rows it has no number in (``row[f"{backend}_error"]``),
    once per reason, with how many rows gave it: what the tables' nan and n/a stand for."""
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        for key, reason in r.items():
            if key.endswith("_error") and reason:
                name = key.removesuffix("_error")
                counts[name, str(reason)] = counts.get((name, str(reason)), 0) + 1
    return [f"{name}: {reason} ({n} of {len(rows)} rows)" for (name, reason), n in counts.items()]


# ---------------------------------------------------------------------------------------------
# Decode: one query token over a KV cache (the FlashDecoding target).
# ---------------------------------------------------------------------------------------------
DECODE_BATCHES = (1, 8, 64)
DECODE_SEQLENS = (4096, 32768, 131072)
DECODE_MAX_TOKENS = 2 * 1024 * 1024  # B * L beyond this is skipped (the cache would not fit)


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    seqlen: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V read: 2 * B * Hkv * L * d * 2."""
        return 2 * self.batch * self.heads_kv * self.seqlen * self.head_dim * 2


#: Back-to-back calls per sample of the steady (per-call) decode timing.
DECODE_STEADY_CALLS = 20


def decode_shapes() -> list[DecodeShape]:
    return [DecodeShape(b, n) for b in DECODE_BATCHES for n in DECODE_SEQLENS if b * n <= DECODE_MAX_TOKENS]


def decode_inputs(shape: DecodeShape, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """q (B, 1, Hq, d), full caches (B, L, Hkv, d) and cache_seqlens = L (int32 on the GPU)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    q = torch.randn(shape.batch, 1, shape.heads_q, shape.head_dim, generator=gen, device="cuda", dtype=dtype)
    kv_dims = (shape.batch, shape.seqlen, shape.heads_kv, shape.head_dim)
    k, v = (torch.randn(kv_dims, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    seqlens = torch.full((shape.batch,), shape.seqlen, dtype=torch.int32, device="cuda")
    return q, k, v, seqlens


def run_decode(shape: DecodeShape) -> dict[str, Any]:
    """Microseconds and GB/s of KV read: cupyflash (automatic splits), cupyflash with one split,
    PyTorch SDPA flash and cuDNN (``enable_gqa=True``, bhsd views of the same caches)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupyflash

    q, k, v, seqlens = decode_inputs(shape)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_call(backend: Any) -> Callable[[], Any]:
        def call() -> Any:
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, enable_gqa=True)

        return call

    calls: dict[str, Callable[[], Any]] = {
        "cupyflash": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
        "splits1": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1),
        "fa2fwd": lambda: cupyflash.attention(q, k, v, algorithm="fa2"),
        "flash": sdpa_call(SDPBackend.FLASH_ATTENTION),
        "cudnn": sdpa_call(SDPBackend.CUDNN_ATTENTION),
    }
    row: dict[str, Any] = asdict(shape)
    row["kv_GB"] = round(shape.kv_bytes / 1e9, 3)
    timed = runnable(calls, row)
    for suffix, burst in (("", 1), ("_steady", DECODE_STEADY_CALLS)):
        for name, ms in cuda_times_ms(timed, warmup_ms=100.0, repeat=20, calls=burst).items():
            row[f"{name}{suffix}_us"] = round(ms * 1e3, 1)
            row[f"{name}{suffix}_TBps"] = round(shape.kv_bytes / (ms * 1e-3) / 1e12, 2)
    ref = calls["flash"]().transpose(1, 2).float()
    row["max_abs_diff_vs_flash"] = round(float((calls["cupyflash"]().float() - ref).abs().max()), 5)
    return row


#: (B, L) of the paged-cache table: the issue's page-size targets are set at these shapes.
PAGED_DECODE_SHAPES = ((1, 131072), (8, 32768), (32, 32768), (64, 4096))


def paged_caches(k: Any, v: Any, page_size: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """The caches [B, L, Hkv, d] as pages [B * L / page_size, page_size, Hkv, d] in a shuffled
    order, and the int32 block table [B, L / page_size] that finds them."""
    import torch

    b, length = k.shape[:2]
    per_seq = length // page_size
    order = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = order.reshape(b, per_seq).to(torch.int32)
    pages = []
    for cache in (k, v):
        paged = torch.empty((b * per_seq, page_size, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
        paged[order] = cache.reshape(b * per_seq, page_size, *cache.shape[2:])
        pages.append(paged)
    return pages[0], pages[1], table


def run_paged_decode(shape: DecodeShape, page_sizes: tuple[int, ...]) -> dict[str, Any]:
    """Steady microseconds (20 back-to-back calls a sample) and TB/s of KV read of cupyflash's
    decode on the contiguous caches and on the same caches paged at each page size, interleaved
    in one process, and each page size's throughput over the contiguous cache's."""
    import cupyflash

    q, k, v, seqlens = decode_inputs(shape)
    calls: dict[str, Callable[[], Any]] = {
        "contiguous": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
    }
    want = calls["contiguous"]()
    row: dict[str, Any] = asdict(shape)
    for page_size in page_sizes:
        k_pages, v_pages, table = paged_caches(k, v, page_size)
        call = functools.partial(
            cupyflash.attention_with_kvcache, q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table
        )
        assert bool((call() == want).all()), f"page size {page_size}: not the contiguous cache's bits"
        calls[f"page{page_size}"] = call
    for name, ms in cuda_times_ms(calls, warmup_ms=100.0, repeat=20, calls=DECODE_STEADY_CALLS).items():
        row[f"{name}_us"] = round(ms * 1e3, 1)
        row[f"{name}_TBps"] = round(shape.kv_bytes / (ms * 1e-3) / 1e12, 2)
    for page_size in page_sizes:
        row[f"page{page_size}_over_contiguous"] = round(row["contiguous_us"] / row[f"page{page_size}_us"], 3)
    return row


#: (B, L) of the batch_invariant table: issue 41's grid (B in 1, 8, 32, 64; L in 4k, 32k, 128k),
#: where the cache fits (DECODE_MAX_TOKENS). Its cost target: within 10% of the default at B * L
#: >= 256k.
BATCH_INVARIANT_SHAPES = tuple(
    (b, n) for b in (1, 8, 32, 64) for n in (4096, 32768, 131072) if b * n <= DECODE_MAX_TOKENS
)
#: A paged row's table this many times wider than its keys (``*_wide``): a serving engine's table
#: sized for its longest context, whose capacity the batch-invariant grid covers (the splits past a
#: sequence's keys exit at once).
BATCH_INVARIANT_WIDE_TABLE = 4


def run_batch_invariant_decode(
    shape: DecodeShape, page_size: int = 0, *, timings: tuple[str, ...] = TIMINGS, repeat: int = 20
) -> dict[str, Any]:
    """The cost of ``batch_invariant=True``: the cache call with the flag beside the default on the
    same inputs (contiguous caches, or paged at ``page_size``; paged rows also with the table
    BATCH_INVARIANT_WIDE_TABLE times wider than the keys: ``default_wide``, ``invariant_wide``),
    under each of ``timings`` (:func:`three_timings_ms`). The row holds each call's microseconds
    and TB/s of KV read per timing (``row["timings"][timing][name]`` in us), ``cost_<timing>`` =
    invariant us / default us (the target: <= 1.10 at B * L >= 256k), ``wide_cost_<timing>`` the
    same of the wide table, and the largest difference of the two outputs (rounding only)."""
    import torch

    import cupyflash

    torch.cuda.empty_cache()  # (the previous row's caches, freed)
    q, k, v, seqlens = decode_inputs(shape)
    table = None
    if page_size:
        k, v, table = paged_caches(k, v, page_size)

    def call(block_table: Any, batch_invariant: bool) -> Callable[[], Any]:
        return functools.partial(
            cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens, block_table=block_table,
            batch_invariant=batch_invariant,
        )  # fmt: skip

    calls = {"default": call(table, False), "invariant": call(table, True)}
    if table is not None:
        wide = torch.nn.functional.pad(table, (0, (BATCH_INVARIANT_WIDE_TABLE - 1) * table.shape[1]))
        calls |= {"default_wide": call(wide, False), "invariant_wide": call(wide, True)}
    row: dict[str, Any] = {**asdict(shape), "page_size": page_size, "kv_GB": round(shape.kv_bytes / 1e9, 3)}
    row["max_abs_diff"] = round(float((calls["invariant"]().float() - calls["default"]().float()).abs().max()), 5)
    times = three_timings_ms(calls, repeat=repeat, warmup_ms=100.0, timings=timings)
    row["timings"] = {t: {name: round(ms * 1e3, 1) for name, ms in by_name.items()} for t, by_name in times.items()}
    for timing, by_name in times.items():
        for name, ms in by_name.items():
            row[f"{name}_{timing}_TBps"] = round(shape.kv_bytes / (ms * 1e-3) / 1e12, 2)
        row[f"cost_{timing}"] = round(by_name["invariant"] / by_name["default"], 3)
        if table is not None:
            row[f"wide_cost_{timing}"] = round(by_name["invariant_wide"] / by_name["default_wide"], 3)
    return row


def format_batch_invariant_table(rows: list[dict[str, Any]]) -> str:
    """One line per (shape, layout): the default's and the batch-invariant call's us under each
    timing, the cost (invariant / default) under each, and, paged, the wide table's cost."""
    lines = []
    for r in rows:
        timings = r["timings"]
        us = " ".join(f"{t[:6]} {timings[t]['default']:>8.1f} {timings[t]['invariant']:>8.1f}" for t in timings)
        cost = " ".join(f"{r[f'cost_{t}']:>5.3f}" for t in timings)
        wide = " ".join(f"{r[f'wide_cost_{t}']:>5.3f}" for t in timings) if r["page_size"] else "-"
        lines.append(
            f"B={r['batch']:>2} L={r['seqlen']:>6} page={r['page_size']:>2} | default / invariant us: {us} | "
            f"cost {cost} | wide table {wide}"
        )  # fmt: skip
    return "\n".join(lines)


#: (B, L) of the tree-mask table (speculative decoding): one long sequence, a mid batch, a large
#: batch of short caches; each with TREE_DRAFTS draft tokens.
TREE_DECODE_SHAPES = ((1, 32768), (8, 32768), (64, 4096))
TREE_DRAFTS = (2, 4, 8, 16)


def binary_tree_mask(drafts: int) -> Any:
    """The bool (drafts, drafts) tree mask of a binary draft tree (draft i's parent (i - 1) // 2,
    the shape of a speculative decoder's top-2 expansion): row i true at i and its ancestors."""
    import numpy as np

    mask = np.eye(drafts, dtype=bool)
    for i in range(1, drafts):
        mask[i] |= mask[(i - 1) // 2]
    return mask


def run_tree_decode(
    shape: DecodeShape, drafts: int, *, timings: tuple[str, ...] = TIMINGS, repeat: int = 20
) -> dict[str, Any]:
    """A speculative decoding step over full caches: ``drafts`` query tokens through a binary
    tree mask (``tree``) beside the causal chain of as many tokens (``causal``, the cost of the
    tree variant) and PyTorch SDPA with the same tree as a boolean ``attn_mask`` (``sdpa_mask``:
    (1, 1, drafts, L), every key before the drafts true; ``enable_gqa``), under each of
    ``timings`` (:func:`three_timings_ms`). The row: us and TB/s of KV read per call and timing,
    ``cost_<timing>`` = tree us / causal us, ``speedup_<timing>`` = SDPA us / tree us, and the
    largest difference of the tree's output from SDPA's."""
    import torch

    import cupyflash

    torch.cuda.empty_cache()  # (the previous row's caches, freed)
    _, k, v, seqlens = decode_inputs(shape)
    gen = torch.Generator(device=k.device).manual_seed(1)
    q = torch.randn(shape.batch, drafts, shape.heads_q, shape.head_dim, generator=gen, device=k.device,
                    dtype=k.dtype)  # fmt: skip
    tree = torch.from_numpy(binary_tree_mask(drafts)).to(k.device)
    visible = torch.ones(1, 1, drafts, shape.seqlen, dtype=torch.bool, device=k.device)
    visible[..., shape.seqlen - drafts :] = tree
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: dict[str, Callable[[], Any]] = {
        "tree": functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens, tree_mask=tree),
        "causal": functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens, causal=True),
        "sdpa_mask": lambda: sdpa(qt, kt, vt, attn_mask=visible, enable_gqa=True),
    }
    row: dict[str, Any] = {**asdict(shape), "drafts": drafts, "kv_GB": round(shape.kv_bytes / 1e9, 3)}
    timed = runnable(calls, row)
    if "sdpa_mask" in timed:
        ref = timed["sdpa_mask"]().transpose(1, 2).float()
        row["max_abs_diff_vs_sdpa"] = round(float((calls["tree"]().float() - ref).abs().max()), 5)
    times = three_timings_ms(timed, repeat=repeat, warmup_ms=100.0, timings=timings)
    row["timings"] = {t: {name: round(ms * 1e3, 1) for name, ms in by_name.items()} for t, by_name in times.items()}
    for timing, by_name in times.items():
        for name, ms in by_name.items():
            row[f"{name}_{timing}_TBps"] = round(shape.kv_bytes / (ms * 1e-3) / 1e12, 2)
        row[f"cost_{timing}"] = round(by_name["tree"] / by_name["causal"], 3)
        if "sdpa_mask" in by_name:
            row[f"speedup_{timing}"] = round(by_name["sdpa_mask"] / by_name["tree"], 2)
    return row


def format_tree_table(rows: list[dict[str, Any]]) -> str:
    """One line per (shape, drafts): tree / causal / SDPA-with-mask us under each timing, the
    tree's cost against causal and its speedup over SDPA (ranges over the timings)."""
    lines = []
    for r in rows:
        timings = r["timings"]
        us = " ".join(
            f"{t[:6]} " + "/".join(f"{timings[t].get(n, float('nan')):.1f}" for n in ("tree", "causal", "sdpa_mask"))
            for t in timings
        )
        cost = " ".join(f"{r[f'cost_{t}']:.3f}" for t in timings)
        speedup = " ".join(f"{r.get(f'speedup_{t}', float('nan')):.2f}" for t in timings)
        lines.append(
            f"B={r['batch']:>2} L={r['seqlen']:>6} drafts={r['drafts']:>2} | tree/causal/sdpa_mask us: {us} | "
            f"cost {cost} | speedup {speedup}"
        )  # fmt: skip
    return "\n".join(lines)


#: Shared-prefix (cascade) decoding: (B, prefix keys, own keys per request, page size). The
#: issue's targets: >= 5x the flat paged call at B = 64 over 32k keys, never slower at B >= 2.
CASCADE_SHAPES = tuple((b, prefix, 512, 16) for prefix in (4096, 32768) for b in (1, 2, 8, 64))


CASCADE_HEADS = (32, 8, 128)  # Hq, Hkv, d of the cascade benchmark


def cascade_calls(batch: int, prefix: int, own: int, page_size: int, device: str = "cuda") -> dict[str, Any]:
    """The cascade benchmark's two calls over one pool of pages (random order, seed 0): a prefix
    of ``prefix`` keys shared by ``batch`` requests of one decode token, each with ``own`` keys of
    its own: "cascade" (attention_with_shared_prefix) and "flat_paged" (attention_with_kvcache,
    each request's table the prefix's pages, then its own); GQA 32/8, d = 128, bf16, PyTorch
    tensors on ``device`` (the CPU stands in for a GPU in host-time studies)."""
    import torch

    import cupyflash

    hq, hkv, d = CASCADE_HEADS
    gen = torch.Generator(device=device).manual_seed(0)
    prefix_pages, own_pages = prefix // page_size, own // page_size
    pages = prefix_pages + batch * own_pages
    k_pool, v_pool = (
        torch.randn(pages, page_size, hkv, d, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2)
    )
    order = torch.randperm(pages, device=device, generator=gen).to(torch.int32)
    prefix_table = order[:prefix_pages].reshape(1, prefix_pages)
    own_table = order[prefix_pages:].reshape(batch, own_pages)
    flat_table = torch.cat([prefix_table.expand(batch, prefix_pages), own_table], dim=1).contiguous()
    q = torch.randn(batch, 1, hq, d, device=device, generator=gen, dtype=torch.bfloat16)
    own_lens = torch.full((batch,), own, dtype=torch.int32, device=device)
    flat_lens = own_lens + prefix
    return {
        "cascade": lambda: cupyflash.attention_with_shared_prefix(
            q, k_pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=prefix, block_table=own_table,
            cache_seqlens=own_lens,
        ),
        "flat_paged": lambda: cupyflash.attention_with_kvcache(
            q, k_pool, v_pool, cache_seqlens=flat_lens, block_table=flat_table
        ),
    }  # fmt: skip


def run_cascade(
    batch: int, prefix: int, own: int, page_size: int, *, timings: tuple[str, ...] = TIMINGS, repeat: int = 20
) -> dict[str, Any]:
    """Microseconds per call of attention_with_shared_prefix against the flat paged call over the
    same pages (:func:`cascade_calls`), in one process under each of ``timings``
    (:func:`three_timings_ms`); the flat call's time over the cascade's (``speedup_<timing>``),
    and their largest difference."""
    check_timings(timings)
    calls: dict[str, Callable[[], Any]] = cascade_calls(batch, prefix, own, page_size)
    hq, hkv, _ = CASCADE_HEADS
    row: dict[str, Any] = {"batch": batch, "prefix": prefix, "own": own, "page_size": page_size, "hq": hq, "hkv": hkv}
    row["max_abs_diff"] = round(float((calls["cascade"]().float() - calls["flat_paged"]().float()).abs().max()), 5)
    times = three_timings_ms(calls, repeat=repeat, timings=timings, warmup_ms=100.0)
    row["timings"] = {t: {name: round(ms * 1e3, 1) for name, ms in by_name.items()} for t, by_name in times.items()}
    for timing, by_name in times.items():
        row[f"speedup_{timing}"] = round(by_name["flat_paged"] / by_name["cascade"], 2)
    return row


def format_cascade_table(rows: list[dict[str, Any]]) -> str:
    """One line per shape: cascade / flat paged us under each timing and the speedups."""
    lines = []
    for r in rows:
        us = " ".join(
            f"{t[:6]} {by['cascade']:.1f}/{by['flat_paged']:.1f}" for t, by in r["timings"].items()
        )  # fmt: skip
        speedup = " ".join(f"{r[f'speedup_{t}']:.2f}" for t in r["timings"])
        lines.append(
            f"B={r['batch']:>2} prefix={r['prefix']:>5} | cascade/flat us: {us} | speedup {speedup} | "
            f"max diff {r['max_abs_diff']}"
        )
    return "\n".join(lines)


#: (B, L) of the float8-cache table (GQA 32/8, d = 128, B * L <= 4M tokens): the issue's target,
#: the e4m3 cache >= 1.8x the bf16 cache's steady speed, is set at L >= 32k.
FP8_DECODE_SHAPES = ((1, 32768), (1, 131072), (8, 32768), (8, 131072), (32, 32768), (32, 131072))
#: Sequences of each shape compared with the float64 reference (the rest are timed only).
FP8_REFERENCE_SEQUENCES = 2


def fp8_caches(k: Any, v: Any) -> tuple[Any, Any, Any, Any]:
    """e4m3 copies of 16-bit caches [B, L, Hkv, d] with one float32 scale per KV head (amax / 448),
    quantised by attention_with_kvcache's rule (round to nearest even, saturated): k, v, k_scale, v_scale."""
    import torch

    out = []
    for cache in (k, v):
        scale = (cache.float().abs().amax(dim=(0, 1, 3)) / 448.0).clamp_min(1e-12)
        quantised = (cache.float() / scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out.append((quantised, scale.contiguous()))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def fp8_reference_error(out: Any, q: Any, k: Any, v: Any, seqlens: Any, k_scale: Any = None, v_scale: Any = None,
                        sequences: int = FP8_REFERENCE_SEQUENCES) -> float:  # fmt: skip
    """||out - ref|| / ||ref|| over the first ``sequences`` sequences, ref the float64 attention
    over the caches as they read (dequantised: float8 * scale, when scales are given)."""
    import torch

    hq, hkv = q.shape[2], k.shape[2]
    num = den = 0.0
    for b in range(min(sequences, q.shape[0])):
        n = int(seqlens[b])
        kb, vb = (c[b, :n].to(torch.float64) for c in (k, v))  # [n, Hkv, d]
        if k_scale is not None:
            kb = kb * k_scale.to(torch.float64)[:, None]
            vb = vb * v_scale.to(torch.float64)[:, None]
        qb = q[b].to(torch.float64).reshape(q.shape[1], hkv, hq // hkv, q.shape[3])  # [Nq, Hkv, g, d]
        scores = torch.einsum("qhgd,nhd->qhgn", qb, kb) / q.shape[3] ** 0.5
        ref = torch.einsum("qhgn,nhd->qhgd", scores.softmax(dim=-1), vb).reshape(q.shape[1], hq, q.shape[3])
        num += float((out[b].to(torch.float64) - ref).square().sum())
        den += float(ref.square().sum())
    return (num / den) ** 0.5


def run_fp8_decode(shape: DecodeShape, page_size: int = 0) -> dict[str, Any]:
    """The bf16 cache against its e4m3 copy (per-KV-head scales) at one shape, contiguous or paged
    (``page_size``), interleaved in one process: single-call and steady (DECODE_STEADY_CALLS
    back-to-back calls a sample) microseconds, TB/s of the KV bytes each reads, the e4m3 cache's
    steady speed over the bf16 cache's, and each one's error against the float64 reference of
    the cache it reads (dequantised for e4m3)."""
    import torch

    import cupyflash

    q, k, v, seqlens = decode_inputs(shape)
    k8, v8, k_scale, v_scale = fp8_caches(k, v)
    caches: dict[str, tuple[Any, ...]] = {"bf16": (k, v), "e4m3": (k8, v8)}
    table = None
    if page_size:
        k_pages, v_pages, table = paged_caches(k, v, page_size)
        # (paged as bytes: torch indexes float8 tensors in few ops; the same seed gives the same table)
        byte_pages = paged_caches(k8.view(torch.uint8), v8.view(torch.uint8), page_size)
        k8_pages, v8_pages = (x.view(torch.float8_e4m3fn) for x in byte_pages[:2])
        caches = {"bf16": (k_pages, v_pages), "e4m3": (k8_pages, v8_pages)}
    scales = {"bf16": {}, "e4m3": {"k_scale": k_scale, "v_scale": v_scale}}
    calls: dict[str, Callable[[], Any]] = {
        name: functools.partial(
            cupyflash.attention_with_kvcache, q, *caches[name], cache_seqlens=seqlens, block_table=table,
            **scales[name],
        )
        for name in caches
    }  # fmt: skip
    row: dict[str, Any] = {**asdict(shape), "page_size": page_size}
    kv_bytes = {"bf16": shape.kv_bytes, "e4m3": shape.kv_bytes // 2}
    for suffix, burst in (("", 1), ("_steady", DECODE_STEADY_CALLS)):
        for name, ms in cuda_times_ms(calls, warmup_ms=100.0, repeat=20, calls=burst).items():
            row[f"{name}{suffix}_us"] = round(ms * 1e3, 1)
            row[f"{name}{suffix}_TBps"] = round(kv_bytes[name] / (ms * 1e-3) / 1e12, 2)
    row["e4m3_speedup_steady"] = round(row["bf16_steady_us"] / row["e4m3_steady_us"], 3)
    row["e4m3_speedup"] = round(row["bf16_us"] / row["e4m3_us"], 3)
    row["bf16_error"] = fp8_reference_error(calls["bf16"](), q, k, v, seqlens)
    row["e4m3_error"] = fp8_reference_error(calls["e4m3"](), q, k8, v8, seqlens, k_scale, v_scale)
    del caches, calls
    torch.cuda.empty_cache()
    return row


def format_fp8_decode_table(rows: list[dict[str, Any]]) -> str:
    """One line per (shape, layout): steady and single-call us and TB/s of the bf16 and e4m3
    caches, the e4m3 cache's speed-up, and both errors against the float64 reference."""
    header = (
        f"{'B':>3} {'L':>7} {'page':>4} | {'bf16 us':>8} {'TB/s':>5} {'e4m3 us':>8} {'TB/s':>5} {'x':>5} | "
        f"{'single bf16':>11} {'e4m3':>8} {'x':>5} | {'err bf16':>9} {'err e4m3':>9}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['batch']:>3} {r['seqlen']:>7} {r['page_size']:>4} | {r['bf16_steady_us']:>8.1f} "
            f"{r['bf16_steady_TBps']:>5.2f} {r['e4m3_steady_us']:>8.1f} {r['e4m3_steady_TBps']:>5.2f} "
            f"{r['e4m3_speedup_steady']:>5.2f} | {r['bf16_us']:>11.1f} {r['e4m3_us']:>8.1f} "
            f"{r['e4m3_speedup']:>5.2f} | "
            f"{r['bf16_error']:>9.2e} {r['e4m3_error']:>9.2e}"
        )  # fmt: skip
    return "\n".join(lines)


def decode_host_overhead_us(*, rounds: int = 5, calls: int = 1000) -> dict[str, float]:
    """Host time of one decode call at the smallest shape (B = 1, L = 4096), torch tensors: the
    whole call with the automatic split, and with one split (a single launch)."""
    import torch

    import cupyflash

    q, k, v, seqlens = decode_inputs(DecodeShape(1, 4096))
    calls_by_name = {
        "decode_us": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
        "decode_splits1_us": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1),
        "sdpa_us": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
        ),
    }
    best = {name: float("inf") for name in calls_by_name}
    for call in calls_by_name.values():
        _median_call_us(call, torch.cuda.synchronize, 100)
    for _ in range(rounds):
        for name, call in calls_by_name.items():
            best[name] = min(best[name], _median_call_us(call, torch.cuda.synchronize, calls))
    return {name: round(us, 2) for name, us in best.items()}


def format_decode_table(rows: list[dict[str, Any]], suffix: str = "") -> str:
    """One line per shape: us and TB/s of each entry, the best SDPA backend over cupyflash, and
    one split (and the FA2 forward kernel) over cupyflash. ``suffix`` "_steady" gives the
    back-to-back per-call times, "" the single-call ones."""
    names = ("cupyflash", "splits1", "fa2fwd", "flash", "cudnn")
    header = f"{'B':>3} {'L':>7} {'KV GB':>6} | " + " ".join(f"{n + ' us':>12} {'TB/s':>5}" for n in names)
    lines = [header + " | best SDPA / cupyflash | splits1, fa2fwd / cupyflash"]
    for r in rows:
        cells = []
        for n in names:
            us, tbps = r.get(f"{n}{suffix}_us"), r.get(f"{n}{suffix}_TBps")
            cells.append(
                f"{us if us is not None else float('nan'):>12.1f} {tbps if tbps is not None else float('nan'):>5.2f}"
            )
        ours = r.get(f"cupyflash{suffix}_us") or float("nan")
        best = min((r[f"{n}{suffix}_us"] for n in ("flash", "cudnn") if r.get(f"{n}{suffix}_us")), default=float("nan"))
        slow = [(r.get(f"{n}{suffix}_us") or float("nan")) / ours for n in ("splits1", "fa2fwd")]
        lines.append(
            f"{r['batch']:>3} {r['seqlen']:>7} {r['kv_GB']:>6.2f} | " + " ".join(cells)
            + f" | {best / ours:>5.2f}x | {slow[0]:>5.1f}x {slow[1]:>5.1f}x"
        )  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Varlen: sequences of different lengths packed end to end (a training batch without padding).
# ---------------------------------------------------------------------------------------------
#: Packed tokens per varlen benchmark batch, as the prefill shapes' B x N.
VARLEN_TOKENS = 16384


@dataclass(frozen=True)
class VarlenShape:
    lengths: tuple[int, ...]
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"

    @property
    def flops(self) -> float:
        """The work of each sequence alone (none is spent on padding)."""
        full = sum(4.0 * self.heads * n * n * self.head_dim for n in self.lengths)
        return full / 2 if self.causal else full


def varlen_lengths(
    total: int = VARLEN_TOKENS, shortest: int = 128, longest: int = 4096, seed: int = 0
) -> tuple[int, ...]:
    """Sequence lengths drawn uniformly from [shortest, longest], the last one cut to make
    ``total`` tokens: a fixed, deliberately uneven mix (odd lengths included)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(shortest, longest), total - sum(lengths)))
    return tuple(lengths)


def varlen_shapes() -> list[VarlenShape]:
    lengths = varlen_lengths()
    return [VarlenShape(lengths, 2048 // d, d, causal) for d in PREFILL_HEAD_DIMS for causal in (False, True)]


def _torch_varlen_call(q: Any, k: Any, v: Any, cu: Any, longest: int, causal: bool) -> Callable[[], Any]:
    """PyTorch's own varlen attention (torch.nn.attention.varlen, flash kernels), whose causal
    flag moved from ``is_causal`` to ``window_size=(-1, 0)`` between releases."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    flag = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {"window_size": (-1, 0)}
    extra = flag if causal else {}
    return functools.partial(varlen_attn, q, k, v, cu, cu, longest, longest, **extra)


def run_varlen(shape: VarlenShape) -> dict[str, Any]:
    """TFLOP/s (of the unpadded work) of cupyflash's FA2 and Hopper kernels, its default
    dispatch, and PyTorch's varlen attention, on the same packed inputs."""
    import torch

    import cupyflash

    total, longest = sum(shape.lengths), max(shape.lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = (total, shape.heads, shape.head_dim)
    q, k, v = (torch.randn(dims, generator=gen, device="cuda", dtype=getattr(torch, shape.dtype)) for _ in range(3))
    starts = [0]
    for n in shape.lengths:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    calls: dict[str, Callable[[], Any]] = {
        name: functools.partial(
            cupyflash.attention_varlen, q, k, v, cu, cu, longest, longest, causal=shape.causal, algorithm=algorithm
        )
        for name, algorithm in (("cupyflash", "auto"), ("cupyflash_fa2", "fa2"), ("cupyflash_fa3", "fa3"))
    }
    row: dict[str, Any] = asdict(shape)
    row["sequences"], row["tokens"], row["longest"] = len(shape.lengths), total, longest
    del row["lengths"]
    try:
        calls["torch_varlen"] = _torch_varlen_call(q, k, v, cu, longest, shape.causal)
    except (ImportError, AttributeError) as error:
        row["torch_varlen_error"] = str(error)[:200]
    timed = runnable(calls, row)
    reference = timed["cupyflash_fa2"]().float() if "cupyflash_fa2" in timed else None
    for name, ms in cuda_times_ms(timed).items():
        row[name] = round(shape.flops / ms / 1e9, 1)
        if reference is not None:
            row[f"{name}_max_abs_diff_vs_fa2"] = round(float((timed[name]().float() - reference).abs().max()), 5)
    return row


def format_varlen_table(rows: list[dict[str, Any]]) -> str:
    names = ("cupyflash", "cupyflash_fa2", "cupyflash_fa3", "torch_varlen")
    lines = [f"{'d':>4} {'causal':>6} {'seqs':>4} {'longest':>7} | " + " ".join(f"{n:>13}" for n in names)]
    for r in rows:
        cells = " ".join(f"{r.get(n) or float('nan'):>13.1f}" for n in names)
        lines.append(f"{r['head_dim']:>4} {str(r['causal']):>6} {r['sequences']:>4} {r['longest']:>7} | {cells}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Chunked prefill against a KV cache: a chunk of new query tokens attends to the keys already
# cached plus its own (bottom-right causal), as serving engines run a long prompt in pieces.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkShape:
    batch: int
    cached: int  # keys before the chunk
    chunk: int  # new query tokens (their keys already in the cache)
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def seqlen_k(self) -> int:
        return self.cached + self.chunk

    @property
    def flops(self) -> float:
        """4 H d per visible (query, key) pair: query i of the chunk sees cached + i + 1 keys."""
        pairs = self.chunk * self.cached + self.chunk * (self.chunk + 1) / 2
        return 4.0 * self.batch * self.heads_q * self.head_dim * pairs


CHUNK_SHAPES = (ChunkShape(1, 14336, 2048), ChunkShape(8, 3584, 512), ChunkShape(32, 1920, 128))
CHUNK_PAGE_SIZES = (1, 16, 256)


def run_chunked_prefill(shape: ChunkShape, page_sizes: tuple[int, ...] = CHUNK_PAGE_SIZES) -> dict[str, Any]:
    """TFLOP/s of one chunk of every sequence, interleaved in one process, on the same data:
    ``attention_with_kvcache`` over a contiguous cache and over paged caches; the same packed
    batch through ``attention_varlen`` over the pages (block_table); ``attention`` on the
    contiguous keys (the Hopper kernel where it applies; ``dense_fa2`` the FA2 kernel); and SDPA
    with a lower-right causal bias on repeated K/V heads (GQA expanded outside the timing).
    Results of every cupyflash entry are checked equal (bits) or close (the dense kernels)."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    import cupyflash

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    b, nq, nk, hq, hkv, d = shape.batch, shape.chunk, shape.seqlen_k, shape.heads_q, shape.heads_kv, shape.head_dim
    q = torch.randn(b, nq, hq, d, generator=gen, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, nk, hkv, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    row: dict[str, Any] = asdict(shape)
    calls: dict[str, Callable[[], Any]] = {
        "cache": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=nk, causal=True),
        "dense": lambda: cupyflash.attention(q, k, v, causal=True),
        "dense_fa2": lambda: cupyflash.attention(q, k, v, causal=True, algorithm="fa2"),
    }
    want = calls["cache"]()
    q_packed = q.reshape(b * nq, hq, d)
    cu_q = torch.arange(0, b * nq + 1, nq, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, b * nk + 1, nk, device="cuda", dtype=torch.int32)
    for page_size in page_sizes:
        k_pages, v_pages, table = paged_caches(k, v, page_size)
        cache = functools.partial(
            cupyflash.attention_with_kvcache, q, k_pages, v_pages, cache_seqlens=nk, block_table=table, causal=True
        )
        packed = functools.partial(
            cupyflash.attention_varlen, q_packed, k_pages, v_pages, cu_q, cu_k, nq, nk, causal=True, block_table=table
        )
        assert bool((cache() == want).all()), f"page size {page_size}: not the contiguous cache's bits"
        assert bool((packed().reshape(q.shape) == want).all()), f"varlen page size {page_size}: other bits"
        calls[f"cache_page{page_size}"] = cache
        calls[f"varlen_page{page_size}"] = packed
    dense = calls["dense"]().float()
    row["dense_max_abs_diff"] = float((dense - want.float()).abs().max())
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(hq // hkv, 2), v.repeat_interleave(hq // hkv, 2)))
    bias = causal_lower_right(nq, nk)
    calls["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)
    for name, ms in cuda_times_ms(runnable(calls, row), warmup_ms=200.0, repeat=20).items():
        row[name] = round(shape.flops / ms / 1e9, 1)
        row[f"{name}_ms"] = round(ms, 4)
    return row


# ---------------------------------------------------------------------------------------------
# attn_mask: a key-padding mask, a boolean mask per query row, an additive bias per head, a
# causal mask given as a boolean mask (transformers' 4-D mask).
# ---------------------------------------------------------------------------------------------
MASK_SHAPES = (PrefillShape(4, 4096, 16, 128, False, "bfloat16"), PrefillShape(16, 1024, 16, 128, False, "bfloat16"))
MASK_KINDS = ("key_padding", "bool_rows", "additive_heads", "causal_bool")


def _mask_for(kind: str, shape: PrefillShape, gen: Any) -> Any:
    """key_padding (B, 1, 1, N): each sequence's first quarter hidden (left padding);
    bool_rows (B, 1, N, N): random keep with p = 0.9; additive_heads (1, H, N, N): normal, q's dtype;
    causal_bool (B, 1, N, N): the lower triangle (the kernel's block summary skips the rest)."""
    import torch

    b, n, h = shape.batch, shape.seqlen, shape.heads
    if kind == "key_padding":
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
        keep[..., : n // 4] = False
        return keep
    if kind == "causal_bool":
        return torch.ones(n, n, dtype=torch.bool, device="cuda").tril().expand(b, 1, n, n).contiguous()
    if kind == "bool_rows":
        return torch.rand(b, 1, n, n, generator=gen, device="cuda") < 0.9
    return torch.randn(1, h, n, n, generator=gen, device="cuda").to(getattr(torch, shape.dtype))


def run_masked_prefill(shape: PrefillShape, kind: str) -> dict[str, Any]:
    """TFLOP/s (of the unmasked work) of cupyflash with ``kind``'s mask, without it, and of
    PyTorch SDPA's efficient and cuDNN backends with the same mask, interleaved in one process."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupyflash

    q, k, v = prefill_inputs(shape)
    mask = _mask_for(kind, shape, torch.Generator(device="cuda").manual_seed(1))
    row: dict[str, Any] = {**asdict(shape), "mask": kind, "mask_shape": list(mask.shape)}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa(backend: Any) -> Callable[[], Any]:
        def call() -> Any:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

        return call

    calls: dict[str, Callable[[], Any]] = {
        "cupyflash_mask": lambda: cupyflash.attention(q, k, v, attn_mask=mask),
        "cupyflash_fa2_nomask": lambda: cupyflash.attention(q, k, v, algorithm="fa2"),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    ok = runnable(calls, row)
    if "sdpa_efficient" in ok:  # the same answer as SDPA's on the same mask
        want = ok["sdpa_efficient"]().transpose(1, 2).float()
        row["max_abs_diff_vs_sdpa"] = float((ok["cupyflash_mask"]().float() - want).abs().max())
    for name, ms in cuda_times_ms(ok, warmup_ms=200.0, repeat=20).items():
        row[name] = round(shape.flops / ms / 1e9, 1)
        row[f"{name}_ms"] = round(ms, 4)
    return row


# ---------------------------------------------------------------------------------------------
# score_mod / mask_mod beside FlexAttention and the built-in masks (issue: user score functions)
# ---------------------------------------------------------------------------------------------
#: (B, N, H, d) of the score-function benchmark: 16k tokens, H x d = 2048, at N = 4k and 16k.
MODS_SHAPES = tuple(
    PrefillShape(16384 // n, n, 2048 // d, d, False, "bfloat16") for d in (64, 128) for n in (4096, 16384)
)


def mods_gallery(seqlen: int, heads: int) -> dict[str, dict[str, Any]]:
    """The gallery's functions, each three ways: cupyflash's (``score_mod`` / ``mask_mod`` with
    ``cupyflash.mods``), FlexAttention's (torch ops; ``mask`` for its block mask) and the built-in
    options computing the same attention where cupyflash has them (None otherwise). Document
    masking packs four documents of random lengths (seed 0); ALiBi has a slope per head."""
    import torch

    from . import mods

    gen = torch.Generator(device="cuda").manual_seed(0)
    bounds = torch.sort(torch.randint(1, seqlen, (3,), generator=gen, device="cuda")).values
    doc = torch.bucketize(torch.arange(seqlen, device="cuda"), bounds, right=True).to(torch.int32)
    window, cap = 1024, 30.0
    slopes = alibi_slopes(heads)
    return {
        "causal": {"mask_mod": lambda b, h, i, j: j <= i, "flex_mask": lambda b, h, i, j: j <= i,
                   "builtin": {"causal": True}},
        "sliding_window": {"mask_mod": lambda b, h, i, j: (j <= i) & (i - j < window),
                           "flex_mask": lambda b, h, i, j: (j <= i) & (i - j < window),
                           "builtin": {"causal": True, "window": (window - 1, 0)}},
        "document_causal": {"mask_mod": lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i),
                            "flex_mask": lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), "builtin": None},
        # no causal term: the mask alone implies no summary (its backward: the Hopper one's hook)
        "document": {"mask_mod": lambda b, h, i, j: doc[i] == doc[j],
                     "flex_mask": lambda b, h, i, j: doc[i] == doc[j], "builtin": None},
        "softcap": {"score_mod": lambda s, b, h, i, j: cap * mods.tanh(s / cap),
                    "flex_score": lambda s, b, h, i, j: cap * torch.tanh(s / cap), "builtin": {"softcap": cap}},
        "alibi": {"score_mod": lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j),
                  "flex_score": lambda s, b, h, i, j: s - slopes[h] * (i - j).abs(),
                  "builtin": {"alibi_slopes": slopes}},  # (flash-attn's |i + Nk - Nq - j|; Nq = Nk here)
    }  # fmt: skip


def run_mods(
    shape: PrefillShape, name: str, functions: dict[str, Any], backward: bool, timings: tuple[str, ...] = TIMINGS
) -> dict[str, Any]:
    """ms of one gallery function (forward, or forward + backward through autograd) under the
    three timings: cupyflash's score functions, torch's compiled FlexAttention with the same
    functions, FlashAttention-4 with them ("fa4": FlexAttention's FLASH backend, which compiles
    the functions into FA4's CuTe kernels, where flash-attn-4 is installed and takes them), and
    cupyflash's built-in options where they compute the same attention; the largest difference
    from FlexAttention's output. A mask function runs with its block mask on
    both sides (each made once, outside the timing, as a fixed mask is used: cupyflash's
    ``create_block_mask`` and FlexAttention's), and on ours without it too ("cupyflash_mask_mod":
    the mask alone, its tiles classed by its own trace (_mod_tiles); ``over_mask_mod_*`` the block
    mask's speed-up over it, ``alone_over_builtin_*`` the built-in path's time over it)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import cupyflash

    q, k, v = prefill_inputs(shape)
    if backward:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    row: dict[str, Any] = {**asdict(shape), "function": name, "backward": backward}
    score_mod, mask_mod = functions.get("score_mod"), functions.get("mask_mod")
    n = shape.seqlen
    block_mask = ours_block = None
    if functions.get("flex_mask") is not None:
        block_mask = create_block_mask(functions["flex_mask"], None, None, n, n, device="cuda")
    if mask_mod is not None:  # in place of mask_mod: the same function, with its summary
        ours_block = cupyflash.create_block_mask(mask_mod, None, None, n, n, device="cuda")
        row["block_mask_sparsity"] = round(ours_block.sparsity(), 2)
    # Each function (and shape) is a recompile of flex_attention: past Dynamo's recompile limit
    # (8) it would fall back to the uncompiled FlexAttention, which materialises the scores.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def step(forward: Callable[[], Any]) -> Callable[[], Any]:
        if not backward:
            return forward
        return lambda: torch.autograd.grad(forward(), (q, k, v), dout)

    masking = {"mask_mod": mask_mod} if ours_block is None else {"block_mask": ours_block}
    calls: dict[str, Callable[[], Any]] = {
        "cupyflash_mods": step(lambda: cupyflash.attention(q, k, v, score_mod=score_mod, **masking)),
        "flex": step(
            lambda: flex(qt, kt, vt, score_mod=functions.get("flex_score"), block_mask=block_mask).transpose(1, 2)
        ),
    }
    try:  # (the check that flash_attn.cute is FlashAttention-4, not cupyflash's drop-in)
        fa4_attention()
        flash: Any = {"BACKEND": "FLASH"}  # (torch types it FlexKernelOptions)
        calls["fa4"] = step(
            lambda: flex(
                qt, kt, vt, score_mod=functions.get("flex_score"), block_mask=block_mask, kernel_options=flash
            ).transpose(1, 2)
        )
    except (ImportError, RuntimeError) as error:  # (RuntimeError: flash_attn.cute is cupyflash's drop-in)
        row["fa4"], row["fa4_error"] = None, str(error)
    if ours_block is not None:
        calls["cupyflash_mask_mod"] = step(lambda: cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod))
    if functions["builtin"] is not None:
        calls["cupyflash_builtin"] = step(lambda: cupyflash.attention(q, k, v, **functions["builtin"]))
    ok = runnable(calls, row)
    if {"cupyflash_mods", "flex"} <= ok.keys():
        with torch.no_grad():
            ours = cupyflash.attention(q, k, v, score_mod=score_mod, **masking).float()
            theirs = flex(qt, kt, vt, score_mod=functions.get("flex_score"), block_mask=block_mask)
            row["max_abs_diff_vs_flex"] = float((ours - theirs.transpose(1, 2).float()).abs().max())
            if "fa4" in ok:  # (a peer timed only where its answer is the same attention)
                fa4 = flex(qt, kt, vt, score_mod=functions.get("flex_score"), block_mask=block_mask,
                           kernel_options={"BACKEND": "FLASH"})  # fmt: skip
                row["max_abs_diff_fa4_vs_flex"] = float((fa4.float() - theirs.float()).abs().max())
    row["timings_ms"] = {
        timing: {key: round(ms, 4) for key, ms in by_name.items()}
        for timing, by_name in three_timings_ms(ok, repeat=15, warmup_ms=200.0, timings=timings).items()
    }
    for timing, ms in row["timings_ms"].items():
        if "cupyflash_mods" in ms and "flex" in ms:
            row[f"over_flex_{timing}"] = round(ms["flex"] / ms["cupyflash_mods"], 3)
        if "cupyflash_mods" in ms and "fa4" in ms:
            row[f"over_fa4_{timing}"] = round(ms["fa4"] / ms["cupyflash_mods"], 3)
        if "cupyflash_mods" in ms and "cupyflash_builtin" in ms:
            row[f"over_builtin_{timing}"] = round(ms["cupyflash_builtin"] / ms["cupyflash_mods"], 3)
        if "cupyflash_mods" in ms and "cupyflash_mask_mod" in ms:
            row[f"over_mask_mod_{timing}"] = round(ms["cupyflash_mask_mod"] / ms["cupyflash_mods"], 3)
        if "cupyflash_mask_mod" in ms and "cupyflash_builtin" in ms:  # the mask_mod alone (its own tile classes)
            row[f"alone_over_builtin_{timing}"] = round(ms["cupyflash_builtin"] / ms["cupyflash_mask_mod"], 3)
    return row


def format_mods_table(rows: list[dict[str, Any]]) -> str:
    """One line per row: the speed-up over FlexAttention, over FlashAttention-4 with the same
    functions, over the built-in path (>1: the score functions are faster), the block mask's over
    the mask_mod alone, and the mask_mod alone over the built-in path, as ranges over the three
    timings."""
    lines = [
        "function           d     N  pass  | over flex (range)   over fa4 (range)    over built-in (range) "
        "block mask (range) alone / built-in | max |diff| vs flex"
    ]

    def span(r: dict[str, Any], prefix: str) -> str:
        values = [r[key] for key in r if key.startswith(prefix)]
        return f"{min(values):.2f}-{max(values):.2f}" if values else "-"

    for r in rows:
        lines.append(
            f"{r['function']:<17} {r['head_dim']:>3} {r['seqlen']:>5}  {'f+b' if r['backward'] else 'fwd':<4} | "
            f"{span(r, 'over_flex_'):<19} {span(r, 'over_fa4_'):<19} {span(r, 'over_builtin_'):<21} "
            f"{span(r, 'over_mask_mod_'):<18} "
            f"{span(r, 'alone_over_builtin_'):<16} | "
            f"{r.get('max_abs_diff_vs_flex', '-')}"
        )
    return "\n".join(lines)
