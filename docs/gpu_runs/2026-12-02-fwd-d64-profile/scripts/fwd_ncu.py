# One forward call per shape for Nsight Compute: cupyflash's Hopper kernel and SDPA cuDNN's, on the
# same inputs, after a warm-up outside the profiled range (cudaProfilerStart/Stop).
# `fwd_ncu.py n1k`: the N = 1k pairs only (the stall-reason profile, ncu_stalls.log).
import sys

import torch
import cupyflash
from cupyflash import bench

shapes = [(64, 1024, False), (64, 1024, True), (64, 4096, False), (128, 1024, False)]
if sys.argv[1:] == ["n1k"]:
    shapes = [(64, 1024, False), (128, 1024, False)]
for d, n, causal in shapes:
    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, "bfloat16")
    q, k, v = bench.prefill_inputs(shape)
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))

    def ours():
        cupyflash.attention(q, k, v, causal=causal)

    def theirs():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

    for _ in range(5):
        ours()
        theirs()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    theirs()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("done", d, n, causal, flush=True)
