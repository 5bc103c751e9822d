"""cProfile of the decode call's host path (B=1, L=4096, torch tensors): auto splits vs one split."""
import cProfile, pstats, io, time, torch, cupyflash
from cupyflash import bench
q, k, v, seqlens = bench.decode_inputs(bench.DecodeShape(1, 4096))
calls = {"auto": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
         "splits1": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1)}
for name, call in calls.items():
    for _ in range(200): call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(2000):
        call()
        if i % 100 == 99: torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(name, "us per call (mean, with syncs every 100):", round((time.perf_counter() - t) / 2000 * 1e6, 2))
    pr = cProfile.Profile(); pr.enable()
    for i in range(2000):
        call()
        if i % 100 == 99: torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[:6000])
