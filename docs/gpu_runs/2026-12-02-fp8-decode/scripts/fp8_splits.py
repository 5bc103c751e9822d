"""The float8 cache's split count at small batches: steady us of num_splits = auto and fixed
counts, beside the bf16 cache (auto), interleaved in one process."""
import functools, torch, cupyflash
from cupyflash import bench
for b, length in ((1, 131072), (1, 32768), (8, 32768)):
    q, k, v, seqlens = bench.decode_inputs(bench.DecodeShape(b, length))
    k8, v8, ks, vs = bench.fp8_caches(k, v)
    calls = {"bf16 auto": functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens)}
    for n in (0, 8, 12, 16, 24, 33, 48, 64):
        calls[f"e4m3 {n or 'auto'}"] = functools.partial(
            cupyflash.attention_with_kvcache, q, k8, v8, cache_seqlens=seqlens, k_scale=ks, v_scale=vs, num_splits=n)
    times = bench.cuda_times_ms(calls, warmup_ms=100.0, repeat=15, calls=bench.DECODE_STEADY_CALLS)
    base = times["bf16 auto"]
    print(f"B={b} L={length}: " + "  ".join(f"{name} {ms*1e3:.1f}us x{base/ms:.2f}" for name, ms in times.items()), flush=True)
    del k8, v8, k, v; torch.cuda.empty_cache()
