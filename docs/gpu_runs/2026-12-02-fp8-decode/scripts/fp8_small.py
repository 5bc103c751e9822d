"""B=1 L=32768: the bf16 cache and its e4m3 copy, twice each (for ncu)."""
import torch, cupyflash
from cupyflash import bench
q, k, v, seqlens = bench.decode_inputs(bench.DecodeShape(1, 32768))
k8, v8, ks, vs = bench.fp8_caches(k, v)
for _ in range(2):
    cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
    cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_scale=ks, v_scale=vs)
torch.cuda.synchronize()
