"""B=8 L=131072 GQA 32/8 d=128: the bf16 cache, its e4m3 copy and an e5m2 copy, each called twice (for ncu)."""
import torch, cupyflash
from cupyflash import bench
q, k, v, seqlens = bench.decode_inputs(bench.DecodeShape(8, 131072))
k8, v8, ks, vs = bench.fp8_caches(k, v)
k5, v5 = k.to(torch.float8_e5m2), v.to(torch.float8_e5m2)
for _ in range(2):
    cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
    cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_scale=ks, v_scale=vs)
    cupyflash.attention_with_kvcache(q, k5, v5, cache_seqlens=seqlens)
torch.cuda.synchronize()
