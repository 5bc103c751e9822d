"""One small FP8 forward call of each variant (odd lengths, GQA), for compute-sanitizer."""

import torch

import cupyflash

gen = torch.Generator().manual_seed(0)
for causal in (False, True):
    q = torch.randn(2, 203, 4, 128, generator=gen).to(torch.float8_e4m3fn).cuda()
    k, v = (torch.randn(2, 261, 2, 128, generator=gen).to(torch.float8_e4m3fn).cuda() for _ in "kv")
    out = cupyflash.attention(q, k, v, causal=causal, k_descale=torch.full((2, 2), 0.5, device="cuda"))
    torch.cuda.synchronize()
    print("causal", causal, "finite", bool(torch.isfinite(out.float()).all()))
