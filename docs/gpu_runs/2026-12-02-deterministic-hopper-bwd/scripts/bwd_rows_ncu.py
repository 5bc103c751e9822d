# One backward per shape for Nsight Compute's kernel durations of the per-row kernels (prep, dq).
import torch, cupyflash
from cupyflash import bench
for d, n in [(64, 4096), (128, 4096), (128, 1024)]:
    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, False, "bfloat16")
    q, k, v = bench.prefill_inputs(shape)
    dout = torch.randn_like(q)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    for det in (False, True):
        for _ in range(2):
            cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=det)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=det)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print("done", d, n, flush=True)
