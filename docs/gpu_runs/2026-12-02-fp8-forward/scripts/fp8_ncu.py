"""One FP8 forward and one bf16 forward of the same inputs for Nsight Compute (d = 128, N = 4k and
16k, non-causal), after a warm-up outside the profiled range (cudaProfilerStart/Stop). Prepared
for the next device call (next_profile.sh): where the FP8 kernel's time goes, since neither more
K / V stages nor exponentials on the FMA pipe moved it (call4, call5)."""

import torch

import cupyflash
from cupyflash import bench

for n in (4096, 16384):
    shape = bench.PrefillShape(16384 // n, n, 16, 128, False, "bfloat16")
    q, k, v = bench.prefill_inputs(shape)
    q8, qs = cupyflash.quantize_fp8(q, per="tensor")
    (k8, ks), (v8, vs) = (cupyflash.quantize_fp8(x) for x in (k, v))
    for _ in range(5):
        cupyflash.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
        cupyflash.attention(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    cupyflash.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
    cupyflash.attention(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("done", n, flush=True)
