"""The causal Hopper forward at d = 64 past the short calls (three consumers taking turns in round
robin on the dynamic schedule, named barriers 4-6): bf16, GQA 4/2, 2333 queries over 2401 keys (a
partial last query block and key block), for compute-sanitizer; prints whether the output is
finite and matches a second call bit for bit.
    usage (GPU machine): compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_fwd64.py"""

import torch

import cupyflash
from cupyflash import _dispatch

q = torch.randn(1, 2333, 4, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 2401, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
assert 2401 > _dispatch.FA3_SHORT_SEQLEN and _dispatch.FA3_FWD_TILES[64, True].consumers == 3
first = cupyflash.attention(q, k, v, causal=True)
second = cupyflash.attention(q, k, v, causal=True)
torch.cuda.synchronize()
print("finite", bool(torch.isfinite(first).all()), "same", bool((first == second).all()), flush=True)
