"""Softcap with ALiBi on the FA2 kernel against each alone and neither (forward; forward +
backward), bf16, 16k tokens, H * d = 2048, one process, interleaved."""

import json

import torch

import cupyflash
from cupyflash import bench

for d in (64, 128, 256):
    for n, causal in ((4096, False), (4096, True)):
        shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, "bfloat16")
        q, k, v = bench.prefill_inputs(shape)
        slopes = (2.0 ** (-8.0 * torch.arange(1, shape.heads + 1) / shape.heads)).float().cuda()
        variants = {"plain": {}, "softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": slopes},
                    "alibi_softcap": {"alibi_slopes": slopes, "softcap": 30.0}}  # fmt: skip
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, algorithm="fa2")
        dout = torch.randn_like(q)
        calls = {}
        for name, extra in variants.items():
            calls[f"fwd_{name}"] = lambda e=extra: cupyflash.attention(q, k, v, causal=causal, algorithm="fa2", **e)
            calls[f"bwd_{name}"] = lambda e=extra: cupyflash.attention_backward(
                dout, q, k, v, out, lse, causal=causal, **e
            )
        ms = bench.cuda_times_ms(calls, repeat=20)
        row = {"d": d, "n": n, "causal": causal}
        row.update({f"{key}_tflops": round(shape.flops * (2.5 if key.startswith("bwd") else 1) / t / 1e9, 1)
                    for key, t in ms.items()})  # fmt: skip
        print(json.dumps(row), flush=True)
