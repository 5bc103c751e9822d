"""A/B of the float8 decode kernel: e4m3 widened by integer ops vs the cvt instruction, ring
stages x2 vs x1, and e5m2; each beside the bf16 cache in the same process (bench.run_fp8_decode)."""
import sys, json
import torch
from cupyflash import bench, _kernels, _plan, _dispatch, _source

orig_render = _source.render
def set_variant(define, factor):
    def render(spec):
        code, opts, name = orig_render(spec)
        return (define + "\n" + code if define else code), opts, name
    _kernels.render = render
    _dispatch.FP8_DECODE_STAGE_FACTOR = factor
    _kernels._compiled.clear()
    _plan.clear_caches()

orig_caches = bench.fp8_caches
def e5m2_caches(k, v):
    out = []
    for cache in (k, v):
        scale = (cache.float().abs().amax(dim=(0, 1, 3)) / 57344.0).clamp_min(1e-12)
        out.append(((cache.float() / scale[:, None]).clamp(-57344.0, 57344.0).to(torch.float8_e5m2), scale.contiguous()))
    return out[0][0], out[1][0], out[0][1], out[1][1]

shapes = [((1, 131072), 0), ((8, 32768), 0), ((32, 32768), 0), ((8, 131072), 0), ((32, 32768), 16), ((32, 32768), 1)]
variants = [("trick s4", "", 2), ("cvt s4", "#define CF_FP8_WIDEN_BY_CVT 1", 2), ("trick s2", "", 1),
            ("cvt s2", "#define CF_FP8_WIDEN_BY_CVT 1", 1)]
rows = []
for label, define, factor in variants + [("e5m2 s4", "", 2)]:
    set_variant(define, factor)
    bench.fp8_caches = e5m2_caches if label.startswith("e5m2") else orig_caches
    for (b, length), page in shapes:
        if label.startswith("e5m2") and page: continue
        r = bench.run_fp8_decode(bench.DecodeShape(b, length), page)
        r["variant"] = label
        rows.append(r)
        print(f"{label:9s} B={b:3d} L={length:6d} page={page:3d} bf16 {r['bf16_steady_us']:8.1f} us {r['bf16_steady_TBps']:.2f} TB/s"
              f" | fp8 {r['e4m3_steady_us']:8.1f} us {r['e4m3_steady_TBps']:.2f} TB/s x{r['e4m3_speedup_steady']:.2f}"
              f" single x{r['e4m3_speedup']:.2f} | err {r['bf16_error']:.2e} {r['e4m3_error']:.2e}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
