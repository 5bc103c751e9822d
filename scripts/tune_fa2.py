"""Measure FA2 tile candidates per head dim on the benchmark shapes (run on the GPU machine).

For each head dim and causal flag, every candidate TileConfig is compiled (in parallel), checked
against the reference on a small input, and timed on the prefill shapes of bench.py; the table
shows TFLOP/s per candidate so that _dispatch.FA2_FWD_TILES can be set from measurements.
"""

from __future__ import annotations

import argparse
import json
import sys

from tuning import candidate_row

from cupyflash import _api, _dispatch, _kernels
from cupyflash._specs import Fa2FwdSpec, TileConfig

CANDIDATES = {
    32: [
        TileConfig(128, 128, 8, q_in_regs=True),
        TileConfig(128, 64, 4),
        TileConfig(64, 64, 4, q_in_regs=True, min_blocks=3),
    ],
    64: [
        TileConfig(128, 64, 4),
        TileConfig(128, 64, 4, stages=3),
        TileConfig(64, 64, 4, q_in_regs=True, min_blocks=3),
        TileConfig(128, 128, 8, q_in_regs=True, overlap=True),
    ],
    96: [TileConfig(128, 64, 8, q_in_regs=True), TileConfig(128, 64, 8, q_in_regs=True, overlap=True)],
    128: [
        TileConfig(128, 128, 8, q_in_regs=True),
        TileConfig(128, 128, 8, stages=3, q_in_regs=True),
        TileConfig(128, 32, 4, min_blocks=2),
        TileConfig(64, 64, 4, q_in_regs=True, overlap=True, min_blocks=2),
    ],
    192: [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(128, 32, 8)],
    256: [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(64, 64, 4, overlap=True)],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=sorted(CANDIDATES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    import cupy

    device = cupy.cuda.runtime.getDevice()
    specs = [
        Fa2FwdSpec(args.dtype, d, tile, causal=causal)
        for d in args.head_dims
        for tile in CANDIDATES[d]
        for causal in (False, True)
    ]
    compiled = {k.spec: k for k in _kernels.warmup(specs, device, workers=16)}
    results = []
    for d in args.head_dims:
        for tile in CANDIDATES[d]:
            kernels = [compiled[Fa2FwdSpec(args.dtype, d, tile, causal=c)] for c in (False, True)]
            regs = "/".join(str(k.num_regs) for k in kernels)
            if any(k.local_bytes for k in kernels):
                print(f"d={d} {tile}: spills ({[k.local_bytes for k in kernels]} B), skipped")
                continue
            _dispatch.FA2_FWD_TILES[d] = (tile,)
            _api._plans.clear()
            results.append(candidate_row(d, args.dtype, tile, regs, "fa2"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
