"""Where the host time of a tiny call goes (run on the GPU machine): cProfile of many calls,
plus the time of each step alone, for torch tensors and CuPy arrays, and for a decode step at
the decode benchmark's smallest shape."""

from __future__ import annotations

import cProfile
import pstats
import time

import cupy
import torch

import cupyflash
from cupyflash import _api, _interop
from cupyflash._params import ATTN_PARAMS_DTYPE, ATTN_PARAMS_FIELDS, pack_attn_params_into
from cupyflash._validate import attention_problem
from cupyflash.bench import DecodeShape, decode_inputs


def per_call_us(fn, calls=3000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn()
        if i % 200 == 199:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
    cupyflash.attention(q, k, v, causal=True)
    options = (True, None, (-1, -1), 0.0, "bshd", "auto")
    names = lambda: ("bfloat16",) * 3  # noqa: E731
    plan = _api._plan_for((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), names, 0, options)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    strides = (q.stride(), k.stride(), v.stride())
    out = torch.empty_like(q)
    stream = _interop.torch_current_stream(0)
    buffer = memoryview(bytearray(ATTN_PARAMS_DTYPE.itemsize))
    dq, dk, dv, seqlens = decode_inputs(DecodeShape(1, 4096))
    steps = {
        "decode call (auto splits)": lambda: cupyflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=seqlens),
        "decode call (num_splits=1)": lambda: cupyflash.attention_with_kvcache(
            dq, dk, dv, cache_seqlens=seqlens, num_splits=1
        ),
        "whole call, torch": lambda: cupyflash.attention(q, k, v, causal=True),
        "whole call, cupy": lambda: cupyflash.attention(qc, kc, vc, causal=True),
        "common_placement": lambda: _interop.common_placement(q=q, k=k, v=v),
        "attention_problem": lambda: attention_problem(
            q.shape, k.shape, v.shape, causal=True, scale=None, window=(-1, -1), softcap=0.0, layout="bshd"
        ),
        "ptrs + strides x3, torch": lambda: [(x.data_ptr(), x.stride()) for x in (q, k, v)],
        "ptrs + strides x3, cupy": lambda: [(x.data.ptr, _interop.element_strides(x)) for x in (qc, kc, vc)],
        "torch.empty x2": lambda: (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((1, 8, 1), dtype=torch.float32, device=q.device),
        ),
        "cupy.empty x2": lambda: (cupy.empty(qc.shape, dtype=qc.dtype), cupy.empty((1, 8, 1), dtype=cupy.float32)),
        "torch_current_stream": lambda: _interop.torch_current_stream(0),
        "cupy current stream": lambda: cupy.cuda.get_current_stream(),
        "_plan_for (cached)": lambda: _api._plan_for(
            (q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), names, 0, options
        ),
        "pack params": lambda: pack_attn_params_into(buffer, *range(len(ATTN_PARAMS_FIELDS) - 2), 1.0, 1.0),
        "_launch (pack + launch)": lambda: _api._launch(plan, ptrs, strides, out.data_ptr(), 0, stream, "torch", 0),
        "getDevice": lambda: cupy.cuda.runtime.getDevice(),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ),
    }
    for name, fn in steps.items():
        print(f"{name:32} {per_call_us(fn):8.2f} us", flush=True)
    for name in ("whole call, torch", "whole call, cupy", "decode call (auto splits)"):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            steps[name]()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"== cProfile: {name} (2000 calls)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
