"""Kernel time by CUDA events for the pending GPU scripts: the best of 5 rounds of `reps` calls
back to back, after 3 warm-up calls (compiles, plans), in microseconds a call."""

import torch


def kernel_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return round(best, 1)
