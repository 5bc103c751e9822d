"""One causal backward of the Hopper kernel at d = 64 and 128 (bf16, GQA 4/2, 300 queries over 333
keys: a partial last step and key block), for compute-sanitizer, with _dispatch flags set first
(NAME=0|1 arguments, e.g. FA3_BWD_LATE_EXP=0 FA3_BWD_DECOUPLED=1; causal=0: without the causal
mask, d = 128's 80-row steps); prints each head dim and whether its gradients are finite. With
the producer's rows (the default since 2026-12-07) racecheck reports each bulk copy's write
against the rows' reads, which an mbarrier orders (scripts/sanitize.py sets those aside).
    usage (GPU machine): compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py [NAME=0|1 ...]"""

import sys

import torch

import cupyflash
from cupyflash import _dispatch, _plan

causal = True
for setting in sys.argv[1:]:
    name, value = setting.split("=")
    if name == "causal":
        causal = bool(int(value))
    else:
        setattr(_dispatch, name, bool(int(value)))
_plan.clear_caches()
for d in (64, 128):
    q = torch.randn(1, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 333, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cupyflash.attention_backward(torch.randn_like(q), q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    print(d, bool(torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()), flush=True)
