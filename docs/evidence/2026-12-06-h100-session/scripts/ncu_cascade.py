"""Nsight Compute over one cascade call and one flat paged call at a batch where the cascade
loses (issue 41: B = 1 and 2, 4k prefix, GQA 32/8, d = 128, pages of 16, 512 own keys; both
plans launch 72 CTAs, yet the cascade's call takes about 6 us more): bench.cascade_calls'
inputs, each call warmed (compiled) first, then profiled between cudaProfilerStart and Stop.
    usage (GPU machine): ncu --clock-control none --profile-from-start off --section ... \\
        python3 docs/evidence/2026-12-06-h100-session/scripts/ncu_cascade.py BATCH PREFIX"""

import sys

import torch

from cupyflash import bench

calls = bench.cascade_calls(int(sys.argv[1]), int(sys.argv[2]), own=512, page_size=16)
cascade, flat = calls["cascade"], calls["flat_paged"]
for _ in range(3):
    cascade(), flat()
torch.cuda.synchronize()
torch.cuda.profiler.start()
cascade()
flat()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
