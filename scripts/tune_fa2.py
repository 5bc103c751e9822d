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
            _api._plans.clear()
            # correctness on awkward shapes first (odd lengths, Nq != Nk, GQA, causal, window)
            rng = np.random.default_rng(d)
            err = 0.0
            for nq, nk, causal, window in (
                (300, 333, True, (-1, -1)),
                (77, 200, False, (-1, -1)),
                (129, 64, False, (20, 7)),
            ):
                q, k, v = (
                    torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda().to(getattr(torch, args.dtype))
                    for s in ((2, nq, 4, d), (2, nk, 2, d), (2, nk, 2, d))
                )
                out = cupyflash.attention(q, k, v, causal=causal, window=window)
                ref = reference.attention(q, k, v, causal=causal, window=window)
                err = max(err, float(np.linalg.norm(reference.to_numpy64(out) - ref) / np.linalg.norm(ref)))
            row = {"head_dim": d, "tile": repr(tile), "regs": regs, "err": err}
            for n in bench.PREFILL_SEQLENS:  # the benchmark's shapes: H * d = 2048, B * N = 16384
                for causal in (False, True):
                    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, args.dtype)
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
