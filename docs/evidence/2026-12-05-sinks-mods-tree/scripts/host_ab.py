"""Host time per tiny call of the tree on PYTHONPATH (torch and CuPy, one query token, a 1k
prefill, a cache decode step) beside PyTorch SDPA in the same process: each call's median over
1000 calls (a sync every 100), the fastest of 5 interleaved rounds."""
import statistics, sys, time
import cupy, torch
import cupyflash

def med(call, sync, n):
    s = []
    for i in range(n):
        t = time.perf_counter(); call(); s.append(time.perf_counter() - t)
        if i % 100 == 99: sync()
    sync()
    return statistics.median(s) * 1e6

ts, cs = torch.cuda.synchronize, cupy.cuda.Device().synchronize
tq = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
tk, tv = (torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cq, ck, cv = (cupy.asarray(x.float().cpu().numpy()).astype(cupy.float16) for x in (tq, tk, tv))
pq, pk, pv = (torch.randn(1, 1024, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
kc, vc = (torch.randn(8, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
dq = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
lens = torch.full((8,), 4000, dtype=torch.int32, device="cuda")
sq, sk, sv = (x.transpose(1, 2) for x in (tq, tk, tv))
sdpa = torch.nn.functional.scaled_dot_product_attention
calls = {
    "attention 1 token, torch": (lambda: cupyflash.attention(tq, tk, tv, causal=True), ts),
    "attention 1 token, cupy": (lambda: cupyflash.attention(cq, ck, cv, causal=True), cs),
    "attention prefill 1k, torch": (lambda: cupyflash.attention(pq, pk, pv, causal=True), ts),
    "kvcache decode 8 x 4k, torch": (lambda: cupyflash.attention_with_kvcache(dq, kc, vc, cache_seqlens=lens), ts),
    "sdpa 1 token": (lambda: sdpa(sq, sk, sv), ts),
}
best = dict.fromkeys(calls, float("inf"))
for c, s in calls.values(): med(c, s, 200)
for _ in range(5):
    for name, (c, s) in calls.items():
        best[name] = min(best[name], med(c, s, 1000))
print(cupyflash.__file__)
for name, us in best.items(): print(f"{name:32s} {us:7.2f} us")
