"""Host time of the decode call over the bf16 cache and its e4m3 copy (B=1, L=32768): median of
single calls (the queue kept short), and a cProfile of the fp8 call."""
import cProfile, pstats, io, time, statistics, torch, cupyflash
from cupyflash import bench
q, k, v, seqlens = bench.decode_inputs(bench.DecodeShape(1, 32768))
k8, v8, ks, vs = bench.fp8_caches(k, v)
calls = {"bf16": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
         "e4m3": lambda: cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_scale=ks, v_scale=vs),
         "e4m3 host scales": lambda: cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_scale=0.5, v_scale=0.25)}
for name, call in calls.items():
    for _ in range(100): call()
    torch.cuda.synchronize()
    samples = []
    for i in range(1000):
        t = time.perf_counter(); call(); samples.append(time.perf_counter() - t)
        if i % 20 == 19: torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"{name}: host us median {statistics.median(samples)*1e6:.1f}  p90 {sorted(samples)[900]*1e6:.1f}", flush=True)
pr = cProfile.Profile(); pr.enable()
for i in range(2000):
    calls["e4m3"]()
    if i % 20 == 19: torch.cuda.synchronize()
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:7000])
