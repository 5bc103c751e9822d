"""The FP8 forward's K / V stages: 2 (the 16-bit d = 128 tile's, shipped) against 3 and 4 (its
K and V slots are half the bytes, so more fit), in one process under the three timings, d = 128,
B x N = 16k, H = 16. Each variant is planned directly (_plan.plan_fp8_forward with the tile table
patched) and run by the entry point's own _run."""

import sys

import torch

import cupyflash
from cupyflash import _dispatch, _fp8_forward, _interop, _plan, bench
from cupyflash._specs import Fa3Tile
from cupyflash._validate import check_options

STAGES = (2, 3, 4)
for n in [int(x) for x in sys.argv[1:]] or [1024, 4096, 16384]:
    for causal in (False, True):
        shape = bench.PrefillShape(16384 // n, n, 16, 128, causal, "bfloat16")
        q, k, v = bench.prefill_inputs(shape)
        q8, qs = cupyflash.quantize_fp8(q, per="tensor")
        (k8, ks), (v8, vs) = (cupyflash.quantize_fp8(x) for x in (k, v))
        descales = (qs, ks.expand(shape.batch, -1).contiguous(), vs.expand(shape.batch, -1).contiguous())
        problem = _fp8_forward._problem(q8, k8, v8, check_options(causal, None, (-1, -1), 0.0), "bshd")
        forms = {"q_descale": "tensor", "k_descale": "batch_head", "v_descale": "batch_head"}
        fns, outs = {}, {}
        for stages in STAGES:
            _dispatch.FP8_FWD_TILES[causal] = Fa3Tile(128, stages=stages, pingpong=True, dynamic=causal)
            planned = _plan.plan_fp8_forward(problem, "bfloat16", _plan.device_info(0), tuple(q8.shape), forms)

            def call(planned=planned, arrays=(q8, k8, v8), descales=descales):
                return _fp8_forward._run(planned, _interop.TORCH_LIB, 0, *arrays, descales, descales, False)

            fns[f"s{stages}"] = call
            outs[stages] = call()
        _dispatch.FP8_FWD_TILES[causal] = Fa3Tile(128, stages=2, pingpong=True, dynamic=causal)
        same = all(torch.equal(outs[s], outs[2]) for s in STAGES)
        fns["cudnn"] = bench.sdpa_call("cudnn", q, k, v, causal)
        timings = {
            "single": {name: bench.cuda_time_ms(fn, repeat=30) for name, fn in fns.items()},
            "b2b20": {name: bench.cuda_time_ms(fn, repeat=10, calls=20) for name, fn in fns.items()},
            "interleaved": bench.cuda_times_ms(fns, repeat=30),
        }
        line = f"N={n:5d} causal={int(causal)} outputs identical {same}"
        for timing, ms in timings.items():
            line += f" | {timing}: " + " ".join(f"{name} {t * 1e3:7.1f}" for name, t in ms.items()) + " us "
            line += " ".join(f"s{s}/s2 {ms[f's{s}'] / ms['s2']:.3f}" for s in STAGES[1:])
        print(line, flush=True)
