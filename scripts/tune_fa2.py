"""Measure FA2 tile candidates per head dim on the benchmark shapes (run on the GPU machine).

For each head dim and causal flag, every candidate TileConfig is compiled (in parallel), checked
against the reference on a small input, and timed on the prefill shapes of bench.py; the table
shows TFLOP/s per candidate so that _dispatch.FA2_FWD_TILES can be set from measurements.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import cupyflash
from cupyflash import _api, _dispatch, _kernels, bench, reference
from cupyflash._specs import Fa2FwdSpec, TileConfig

CANDIDATES = {
    32: [TileConfig(128, 128, 8, q_in_regs=True), TileConfig(128, 64, 4, q_in_regs=True), TileConfig(128, 64, 8)],
    64: [
        TileConfig(128, 128, 8, q_in_regs=True),
        TileConfig(128, 64, 4, q_in_regs=True),
        TileConfig(128, 64, 8, q_in_regs=True),
        TileConfig(64, 64, 4, q_in_regs=True),
        TileConfig(128, 128, 8, stages=3, q_in_regs=True),
    ],
    96: [TileConfig(128, 64, 8, q_in_regs=True), TileConfig(128, 64, 8), TileConfig(64, 64, 4, q_in_regs=True)],
    128: [
        TileConfig(128, 64, 8, q_in_regs=True),
        TileConfig(128, 64, 8),
        TileConfig(64, 64, 4, q_in_regs=True),
        TileConfig(128, 128, 8, q_in_regs=True),
        TileConfig(128, 32, 8),
        TileConfig(128, 64, 8, stages=3, q_in_regs=True),
    ],
    192: [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(128, 32, 8)],
    256: [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(128, 32, 8)],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    import cupy
    import torch

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
            _api._launches.clear()
            # correctness on an awkward shape first
            rng = np.random.default_rng(d)
            q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda().to(getattr(torch, args.dtype))
                       for s in ((1, 300, 4, d), (1, 333, 2, d), (1, 333, 2, d)))
            out = cupyflash.attention(q, k, v, causal=True)
            ref = reference.attention(q, k, v, causal=True)
            err = float(np.linalg.norm(reference.to_numpy64(out) - ref) / np.linalg.norm(ref))
            row = {"head_dim": d, "tile": repr(tile), "regs": regs, "err": err}
            for shape in bench.prefill_shapes((args.dtype,)):
                if shape.head_dim != d:
                    continue
                r = bench.run_prefill(shape, backends=("cupyflash",))
                row[f"N{shape.seqlen}{'c' if shape.causal else ''}"] = r["cupyflash"]
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
