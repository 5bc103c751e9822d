"""Measure Hopper-kernel tiles per head dim on the benchmark shapes (run on the GPU machine).

Each candidate (key block, consumer warpgroups, K/V stages) is compiled, checked against the
reference on awkward shapes, and timed on bench.py's prefill shapes; the table of TFLOP/s per
candidate is what _dispatch.FA3_FWD_TILES is set from.
"""

from __future__ import annotations

import argparse
import json
import sys

from tuning import candidate_row, prefill_row

from cupyflash import _api, _dispatch, _kernels, bench
from cupyflash._specs import Fa3FwdSpec, Fa3Tile

# head_dim -> tiles to compare
CANDIDATES = {
    64: [
        Fa3Tile(128, 3, 2),
        Fa3Tile(128, 3, 2, dynamic=True),
        Fa3Tile(128, 2, 4, pingpong=True),
        Fa3Tile(128, 2, 4, pingpong=True, dynamic=True),
    ],
    128: [
        Fa3Tile(128, pingpong=True),
        Fa3Tile(128, pingpong=True, dynamic=True),
    ],
    256: [
        Fa3Tile(64, separate_o=False, pingpong=True),
        Fa3Tile(64, separate_o=False, pingpong=True, dynamic=True),
    ],
}


# Short calls (FA3_SHORT_FWD_TILES): d = 64 tiles at N = 1024, beside cuDNN.
SHORT_CANDIDATES = {
    64: [
        Fa3Tile(128, 2, 4, pingpong=True),
        Fa3Tile(128, 2, 4, pingpong=True, dynamic=True),
        Fa3Tile(128, 2, 2, pingpong=True),
        Fa3Tile(176, 2, 4, pingpong=True),
        Fa3Tile(192, 2, 3, pingpong=True),
        Fa3Tile(128, 3, 4),
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--short", action="store_true", help="the short-call candidates at N = 1024, with cuDNN")
    parser.add_argument("--json")
    args = parser.parse_args()
    candidates = SHORT_CANDIDATES if args.short else CANDIDATES
    seqlens = (1024,) if args.short else bench.PREFILL_SEQLENS
    args.head_dims = args.head_dims or sorted(candidates)
    import cupy

    device = cupy.cuda.runtime.getDevice()
    max_smem = cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]
    specs = [
        Fa3FwdSpec(args.dtype, d, tile, causal=causal)
        for d in args.head_dims
        for tile in candidates[d]
        for causal in (False, True)
    ]
    specs = [s for s in specs if s.smem_bytes <= max_smem]
    compiled = {k.spec: k for k in _kernels.warmup(specs, device, workers=16)}
    results = []
    if args.short:
        for d in args.head_dims:
            results.append({"head_dim": d, "tile": "cudnn", **prefill_row(d, args.dtype, "cudnn", seqlens)})
            print(json.dumps(results[-1]), flush=True)
    for d in args.head_dims:
        for tile in candidates[d]:
            kernels = [compiled.get(Fa3FwdSpec(args.dtype, d, tile, causal=c)) for c in (False, True)]
            if any(k is None for k in kernels):
                print(f"d={d} {tile}: over the shared memory of a block, skipped")
                continue
            regs = "/".join(str(k.num_regs) for k in kernels if k is not None)
            if any(k.local_bytes for k in kernels if k is not None):
                print(f"d={d} {tile}: spills, skipped")
                continue
            _dispatch.FA3_FWD_TILES[d, False] = _dispatch.FA3_FWD_TILES[d, True] = tile
            _dispatch.FA3_SHORT_FWD_TILES.pop((d, False), None)  # the candidate at every length
            _dispatch.FA3_SHORT_FWD_TILES.pop((d, True), None)
            _api._plans.clear()
            results.append(candidate_row(d, args.dtype, tile, regs, "fa3", seqlens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
