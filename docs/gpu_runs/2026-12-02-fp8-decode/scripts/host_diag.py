"""Is the automatic-split decode call's extra host time host code or the GPU queue? The bench's
measure at B=1 L=4096, then the same calls at L=256 (GPU work far below the host time)."""
import statistics, time, torch, cupyflash
from cupyflash import bench
print("bench.decode_host_overhead_us:", bench.decode_host_overhead_us(rounds=3, calls=600), flush=True)
for length in (4096, 256):
    q, k, v, seqlens = bench.decode_inputs(bench.DecodeShape(1, length))
    calls = {"auto": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
             "splits1": lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1),
             "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                 q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)}
    for sync_every in (100, 1):
        out = {}
        for name, call in calls.items():
            for _ in range(50): call()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(3):
                samples = []
                for i in range(400):
                    t = time.perf_counter(); call(); samples.append(time.perf_counter() - t)
                    if i % sync_every == sync_every - 1: torch.cuda.synchronize()
                torch.cuda.synchronize()
                best = min(best, statistics.median(samples) * 1e6)
            out[name] = round(best, 1)
        print(f"L={length} sync every {sync_every}: host us {out}", flush=True)
