"""A/B of the float8 decode tile (occupancy): each candidate beside the bf16 cache in the same
process (bench.run_fp8_decode), d = 128 and 64."""
import sys, json
from dataclasses import replace
from cupyflash import bench, _kernels, _plan, _dispatch
from cupyflash._specs import DecodeTile

orig = _dispatch.decode_spec
def use(tile):
    def decode_spec(dtype, head_dim, rows, causal, local=False, softcap=False, fp8=False):
        spec = orig(dtype, head_dim, rows, causal, local, softcap, fp8)
        return replace(spec, tile=tile) if fp8 and tile is not None else spec
    _dispatch.decode_spec = decode_spec
    _plan.clear_caches()

cands = {128: [("w8 s4 qreg (now)", None), ("w8 s3 b2", DecodeTile(16, 16, 8, 3, q_in_regs=False, min_blocks=2)),
               ("w8 s2 b2", DecodeTile(16, 16, 8, 2, q_in_regs=False, min_blocks=2)),
               ("w4 s3 b4", DecodeTile(16, 16, 4, 3, q_in_regs=False, min_blocks=4))],
         64: [("w8 s4 qreg (now)", None), ("w8 s3 qreg b2", DecodeTile(16, 16, 8, 3, min_blocks=2))]}
shapes = {128: [((1, 131072), 0), ((8, 32768), 0), ((8, 131072), 0), ((32, 32768), 0), ((1, 32768), 0), ((32, 32768), 16)],
          64: [((8, 131072), 0), ((32, 32768), 0)]}
rows = []
for d in (128, 64):
    for label, tile in cands[d]:
        use(tile)
        for (b, length), page in shapes[d]:
            r = bench.run_fp8_decode(bench.DecodeShape(b, length, head_dim=d), page)
            r.update(variant=label, head_dim=d)
            rows.append(r)
            print(f"d{d} {label:17s} B={b:3d} L={length:6d} page={page:3d} bf16 {r['bf16_steady_us']:8.1f} us {r['bf16_steady_TBps']:.2f}"
                  f" | fp8 {r['e4m3_steady_us']:8.1f} us {r['e4m3_steady_TBps']:.2f} x{r['e4m3_speedup_steady']:.2f}"
                  f" single x{r['e4m3_speedup']:.2f} | err {r['bf16_error']:.2e} {r['e4m3_error']:.2e}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
