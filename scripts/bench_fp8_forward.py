"""The FP8 forward beside the bf16 one and SDPA's cuDNN and flash backends, in one process, under the
three timings of DESIGN.md (single calls after warm-up, 20 back-to-back calls between two events,
bench.py's interleaved harness), d = 128, B x N = 16k, H = 16; and its accuracy: RMSE against a
float64 attention of the unquantised (bf16) inputs, for per-head K / V scales and for plain
per-tensor scales, beside the bf16 forward's.

    python scripts/bench_fp8_forward.py [--json OUT] [--seqlens 1024 4096 16384]

The FP8 inputs are ``cupyflash.quantize_fp8`` of the bf16 ones (q per tensor: FlashAttention-3's
q_descale is per KV head). Its time includes V's transpose (fp8_vt.cu), also timed alone.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import cupyflash
from cupyflash import _fp8_forward, _interop, _launch, bench

parser = argparse.ArgumentParser()
parser.add_argument("--json")
parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
args = parser.parse_args()
D, HEADS, TOKENS = 128, 16, 16384


def quantised(q, k, v, per):
    """e4m3 q, k, v and their descales as the call takes them ((B, Hkv) arrays, or 0-d)."""
    b = q.shape[0]
    q8, qs = cupyflash.quantize_fp8(q, per="tensor")
    (k8, ks), (v8, vs) = (cupyflash.quantize_fp8(x, per=per) for x in (k, v))
    as_call = [s.expand(b, -1).contiguous() if s.dim() == 1 else s for s in (ks, vs)]
    return (q8, k8, v8), (qs, *as_call)


def rmse_vs_float64(out, q, k, v, causal):
    """RMSE of out against float64 attention of q, k, v (batch 0, its first two heads)."""
    q64, k64, v64 = (x[0, :, :2].double().transpose(0, 1) for x in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(D)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    ref = torch.softmax(s, dim=-1) @ v64
    return float((out[0, :, :2].double().transpose(0, 1) - ref).pow(2).mean().sqrt())


def host_us(fn, calls: int = 200) -> float:
    """Median host microseconds of one call (the GPU queue is kept from filling: a sync every 20)."""
    import statistics
    import time

    samples = []
    for i in range(calls):
        if i % 20 == 0:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def measure(n: int, causal: bool) -> dict:
    shape = bench.PrefillShape(TOKENS // n, n, HEADS, D, causal, "bfloat16")
    q, k, v = bench.prefill_inputs(shape)
    (q8, k8, v8), (qs, ks, vs) = quantised(q, k, v, "head")
    (p8, pk8, pv8), (pqs, pks, pvs) = quantised(q, k, v, "tensor")
    fns = {
        "fp8": lambda: cupyflash.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs),
        "bf16": lambda: cupyflash.attention(q, k, v, causal=causal),
        "cudnn": bench.sdpa_call("cudnn", q, k, v, causal),
        "flash": bench.sdpa_call("flash", q, k, v, causal),
    }
    row: dict = {"n": n, "causal": causal, "batch": shape.batch}
    if n <= 4096:
        per_tensor = cupyflash.attention(p8, pk8, pv8, causal=causal, q_descale=pqs, k_descale=pks, v_descale=pvs)
        row["rmse"] = {
            "fp8_head_kv": rmse_vs_float64(fns["fp8"](), q, k, v, causal),
            "fp8_per_tensor": rmse_vs_float64(per_tensor, q, k, v, causal),
            "bf16": rmse_vs_float64(fns["bf16"](), q, k, v, causal),
        }
    timings = {
        "single": {name: bench.cuda_time_ms(fn, repeat=30) for name, fn in fns.items()},
        "b2b20": {name: bench.cuda_time_ms(fn, repeat=10, calls=20) for name, fn in fns.items()},
        "interleaved": bench.cuda_times_ms(fns, repeat=30),
    }
    flops = 4 * shape.batch * HEADS * n * n * D / (2 if causal else 1)
    line = f"N={n:5d} causal={int(causal)}"
    for timing, ms in timings.items():
        row[timing] = {name: round(t * 1e3, 1) for name, t in ms.items()}
        row[f"{timing}_tflops"] = {name: round(flops / t / 1e9, 1) for name, t in ms.items()}
        line += f" | {timing}: " + " ".join(f"{name} {t * 1e3:7.1f}" for name, t in ms.items()) + " us"
        line += f" fp8/bf16 {ms['bf16'] / ms['fp8']:.3f} fp8/cudnn {ms['cudnn'] / ms['fp8']:.3f}"
    # V's transpose alone: the first of the FP8 forward's two Launches
    transpose = next(t for t, main in _fp8_forward._plans.values() if main.outputs[0].shape == tuple(q8.shape))
    vt_ms = bench.cuda_time_ms(
        lambda: _launch.run_outputs(transpose, _interop.TORCH_LIB, 0, {"v": v8}), repeat=10, calls=20
    )
    row["vt_us"] = round(vt_ms * 1e3, 1)
    line += f" | vt {vt_ms * 1e3:.1f} us"
    if n == args.seqlens[0]:  # host time per call: the call's own wall time while the queue runs ahead
        row["host_us"] = {name: round(host_us(fn), 1) for name, fn in fns.items()}
        line += " | host " + " ".join(f"{name} {t:.1f}" for name, t in row["host_us"].items()) + " us"
    if "rmse" in row:
        line += " | rmse " + " ".join(f"{name} {e:.3e}" for name, e in row["rmse"].items())
    print(line, flush=True)
    return row


rows = [measure(n, causal) for n in args.seqlens for causal in (False, True)]
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
