"""Softcap's backward on the Hopper kernel against the mma.sync backward that ran it before (the
Hopper backward's spec hidden), and the Hopper backward without softcap; bf16, B x N = 16k,
H x d = 2048, one process, interleaved. Every call rebuilds its plan (the same host cost for
each), so the swap of kernels takes effect per call."""

import json

import torch

import cupyflash
from cupyflash import _dispatch, _plan, bench

hopper_spec = _dispatch.fa3_bwd_spec


def backward(dout, q, k, v, out, lse, causal, softcap, hopper):
    _dispatch.fa3_bwd_spec = hopper_spec if hopper else (lambda *a, **kw: None)
    _plan.clear_caches()
    try:
        return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, softcap=softcap)
    finally:
        _dispatch.fa3_bwd_spec = hopper_spec


for d in (64, 128):
    for n in (1024, 4096, 16384):
        for causal in (False, True):
            shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, "bfloat16")
            q, k, v = bench.prefill_inputs(shape)
            dout = torch.randn_like(q)
            states = {sc: cupyflash.attention(q, k, v, causal=causal, softcap=sc, return_lse=True) for sc in (0.0, 30.0)}
            calls = {
                f"{name}": (lambda sc=sc, hop=hop: backward(dout, q, k, v, *states[sc], causal, sc, hop))
                for name, sc, hop in (("hopper_plain", 0.0, True), ("hopper_softcap", 30.0, True),
                                      ("fa2_softcap", 30.0, False))  # fmt: skip
            }
            ms = bench.cuda_times_ms(calls, repeat=15)
            row = {"d": d, "n": n, "causal": causal}
            row.update({f"{key}_tflops": round(2.5 * shape.flops / t / 1e9, 1) for key, t in ms.items()})
            row["hopper_over_fa2_softcap"] = round(ms["fa2_softcap"] / ms["hopper_softcap"], 2)
            print(json.dumps(row), flush=True)
