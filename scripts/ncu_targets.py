"""One call of each named case between cudaProfilerStart/Stop, after a warm-up, for
`ncu --profile-from-start off` on the GPU machine: kernel durations and DRAM bytes of cupyflash
beside cuDNN (and cupyflash's one-split decode).

usage: ncu --profile-from-start off [--metrics ...] python scripts/ncu_targets.py CASE [CASE ...]
cases: decode-<B>-<L> (a decode benchmark shape), prefill-<d>-<N>-<causal 0|1> (bf16,
       B = 16384 / N, H = 2048 / d, as the prefill benchmark)
"""

from __future__ import annotations

import functools
import sys


def ncu_target(cases: list[str]) -> None:
    import torch

    import cupyflash
    from cupyflash.bench import DecodeShape, PrefillShape, decode_inputs, prefill_inputs, sdpa_call

    calls = []
    for case in cases:
        kind, *args = case.split("-")
        if kind == "decode":
            b, n = map(int, args)
            q, k, v, seqlens = decode_inputs(DecodeShape(b, n))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def sdpa(qt=qt, kt=kt, vt=vt):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            decode = functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens)
            calls += [
                (f"{case} cupyflash", decode),
                (f"{case} splits1", functools.partial(decode, num_splits=1)),
                (f"{case} cudnn", sdpa),
            ]
        else:
            d, n, causal = map(int, args)
            batch = 16384 // n
            shape = PrefillShape(batch, n, 2048 // d, d, bool(causal), "bfloat16")
            q, k, v = prefill_inputs(shape)
            calls += [
                (f"{case} cupyflash", lambda q=q, k=k, v=v, c=bool(causal): cupyflash.attention(q, k, v, causal=c)),
                (f"{case} cudnn", sdpa_call("cudnn", q, k, v, bool(causal))),
            ]
    for _, fn in calls:  # compile and warm up outside the profiled range
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in calls:
        print("ncu-target", name, flush=True)
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    ncu_target(sys.argv[1:])
