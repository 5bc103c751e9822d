"""A small backward workload for compute-sanitizer (memcheck, racecheck) and for comparing the
two dQ paths: d = 64 and 128 (or those given), causal and not (causal with dropout too), the default
(atomic dQ) and deterministic=True,
printing each gradient's norm and the difference between the paths.

    compute-sanitizer --tool racecheck python scripts/bwd_workload.py [HEAD_DIM ...]   (default 64 128)
"""

import sys

import torch

import cupyflash

torch.manual_seed(0)
for d in [int(a) for a in sys.argv[1:]] or [64, 128]:
    q = torch.randn(1, 100, 2, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 130, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    for causal, dropout_p in ((False, 0.0), (True, 0.0), (True, 0.2)):
        drop = {"dropout_p": dropout_p, "seed": 7}
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, **drop)
        atomic = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **drop)
        det = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, **drop)
        torch.cuda.synchronize()
        for name, x, y in zip("qkv", atomic, det):
            x, y = x.float(), y.float()
            print(f"d={d} causal={causal} dropout={dropout_p} d{name}: atomic {x.norm():.4f} deterministic "
                  f"{y.norm():.4f} difference {(x - y).norm():.4f}")  # fmt: skip
