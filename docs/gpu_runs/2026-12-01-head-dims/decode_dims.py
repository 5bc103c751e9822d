"""Decode at head dims below a tile width: one token, GQA 32/8, bf16, full caches; cupyflash's
attention_with_kvcache and SDPA cuDNN/flash (enable_gqa) on the same inputs, interleaved,
steady (20 back-to-back calls per sample); TB/s of K and V bytes at the caller's head dim."""
import json, functools, torch, cupyflash
from cupyflash import bench
from torch.nn.attention import SDPBackend, sdpa_kernel
for b, length in ((8, 32768), (1, 131072)):
    for d in (64, 80, 96, 128, 160, 192, 224, 256):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, length, 8, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        def sdpa(backend):
            def call():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            return call
        calls = {"cupyflash": functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens),
                 "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
        row = {"B": b, "L": length, "d": d}
        ms = bench.cuda_times_ms(bench.runnable(calls, row), repeat=10, calls=20)
        kv_bytes = 2 * b * length * 8 * d * 2
        for name, t in ms.items():
            row[f"{name}_us"] = round(t * 1e3, 1)
            row[f"{name}_TBs"] = round(kv_bytes / t / 1e9, 2)
        print(json.dumps(row), flush=True)
