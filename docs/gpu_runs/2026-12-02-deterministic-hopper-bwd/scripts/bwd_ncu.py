# One backward call per shape for Nsight Compute: cupyflash's (prep, fa3_bwd, dq) and cuDNN's
# (SDPA autograd), after a warm-up outside the profiled range (cudaProfilerStart/Stop).
import sys, torch, cupyflash
from cupyflash import bench
shapes = [(64, 4096, False), (128, 4096, False), (128, 1024, False), (128, 4096, True)]
for d, n, causal in shapes:
    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, "bfloat16")
    q, k, v = bench.prefill_inputs(shape)
    dout = torch.randn_like(q)
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    qs, ks, vs = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    ours = lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    theirs = lambda: torch.autograd.grad(o, (qs, ks, vs), dout.transpose(1, 2), retain_graph=True)
    for _ in range(3):
        ours(); theirs()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.cuda.nvtx.range_push(f"d{d}_n{n}_c{int(causal)}")
    ours(); theirs()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("done", d, n, causal, flush=True)
