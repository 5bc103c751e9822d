"""Where a training step's time goes: the host time of its forward and backward calls, the kernels
it launches (torch.profiler) and the GPU idle time inside one step, for cupyflash beside cuDNN
(and FlashAttention-4 where ``flash_attn.cute`` is installed), on one shape.

A step timed alone ("single" in DESIGN.md's three timings) holds its host time wherever the GPU
waits for it; 20 steps back to back hide it behind the step before. The gap between the two, per
backend, is what this script takes apart:

    python scripts/step_timeline.py [--d 64] [--n 1024] [--causal] [--steps 20]

Prints per backend: host microseconds of the forward call and of the backward (autograd.grad)
call, the kernels of one step with their GPU microseconds, their sum, and the step's time between
two CUDA events (single, and per step of 20 back to back): single - kernels = the GPU's idle time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import cupyflash
from cupyflash import bench


def _fa4_forward():  # noqa: ANN202
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)[0]


def forwards(causal: bool) -> dict:
    """Each backend's forward on bshd leaves (returns bshd)."""

    def cudnn(q, k, v, causal):  # noqa: ANN001, ANN202
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
        return out.transpose(1, 2)

    found = {"cupyflash": lambda q, k, v, causal: cupyflash.attention(q, k, v, causal=causal), "cudnn": cudnn}
    fa4 = _fa4_forward()
    if fa4 is not None:
        found["fa4"] = fa4
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host-profile", type=int, default=0, help="cProfile this many cupyflash steps (top 30)")
    parser.add_argument("--parts", action="store_true", help="host time of the pieces of a cupyflash step")
    args = parser.parse_args()
    shape = bench.PrefillShape(16384 // args.n, args.n, 2048 // args.d, args.d, args.causal, "bfloat16")
    q, k, v = (x.requires_grad_() for x in bench.prefill_inputs(shape))
    dout = torch.randn_like(q)
    print(f"bf16 B={shape.batch} N={shape.seqlen} H={shape.heads} d={shape.head_dim} causal={shape.causal}")
    for name, forward in forwards(args.causal).items():

        def step(forward=forward):  # noqa: ANN001, ANN202
            return torch.autograd.grad(forward(q, k, v, args.causal), (q, k, v), dout)

        for _ in range(30):  # warm-up: compiles, clocks
            step()
        torch.cuda.synchronize()
        host_fwd, host_bwd = [], []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = forward(q, k, v, args.causal)
            t1 = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), dout)
            t2 = time.perf_counter()
            host_fwd.append((t1 - t0) * 1e6)
            host_bwd.append((t2 - t1) * 1e6)
        torch.cuda.synchronize()
        single = bench.cuda_time_ms(step, repeat=args.steps) * 1e3
        b2b = bench.cuda_time_ms(step, repeat=max(3, args.steps // 4), calls=20) * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = defaultdict(list)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:90]].append(event.time_range.end - event.time_range.start)
        per_step = {kernel: sum(t) / 5 for kernel, t in kernels.items()}
        launches = sum(len(t) for t in kernels.values()) / 5
        print(
            f"{name:10} host us fwd {statistics.median(host_fwd):7.1f} bwd {statistics.median(host_bwd):7.1f} | "
            f"step us single {single:8.1f} back-to-back {b2b:8.1f} | kernels {sum(per_step.values()):8.1f} us "
            f"({launches:.0f} launches) | idle in single {single - sum(per_step.values()):7.1f}"
        )
        for kernel, us in sorted(per_step.items(), key=lambda kv: -kv[1]):
            print(f"    {us:8.1f} us x{len(kernels[kernel]) / 5:.0f}  {kernel}")
        if name == "cupyflash" and args.host_profile:
            profile_host(step, args.host_profile)
        if name == "cupyflash" and args.parts:
            host_parts(q, k, v, dout, args.causal, args.steps)


def host_parts(q, k, v, dout, causal: bool, steps: int) -> None:  # noqa: ANN001
    """Host microseconds of the pieces of a cupyflash training step, each timed with the GPU idle
    before it (a synchronised stream, as a lone step starts): the forward with grad (the eager
    autograd.Function around the op body), without grad (the body alone), autograd.grad (the
    engine around the backward body), attention_backward on detached tensors (the body: the
    executor, its allocations and launches), and the backward's allocations alone."""
    qd, kd, vd = (x.detach() for x in (q, k, v))
    out, lse = cupyflash.attention(qd, kd, vd, causal=causal, return_lse=True)
    graph_out = cupyflash.attention(q, k, v, causal=causal)

    def alone(fn) -> float:  # noqa: ANN001
        fn()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    def grad_of_graph() -> None:
        torch.autograd.grad(graph_out, (q, k, v), dout, retain_graph=True)

    def allocations() -> None:
        [torch.empty_like(x) for x in (q, k, v)] + [torch.empty(q.shape, dtype=torch.float32, device=q.device)]

    parts = {
        "forward, grad (Function + body)": lambda: cupyflash.attention(q, k, v, causal=causal),
        "forward, no grad (body)": lambda: cupyflash.attention(qd, kd, vd, causal=causal),
        "autograd.grad (engine + body)": grad_of_graph,
        "attention_backward (body)": lambda: cupyflash.attention_backward(dout, qd, kd, vd, out, lse, causal=causal),
        "the backward's allocations": allocations,
    }
    for part, fn in parts.items():
        print(f"    host us {alone(fn):8.1f}  {part}")


def profile_host(step, steps: int) -> None:  # noqa: ANN001
    """The host functions of ``steps`` training steps by their own time and by their total."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler).sort_stats(order).print_stats(30)


if __name__ == "__main__":
    main()
