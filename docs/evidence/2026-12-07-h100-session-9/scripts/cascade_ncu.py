"""Nsight Compute over one cascade call and one flat paged call (issue 41): bench.cascade_calls'
inputs (GQA 32/8, d = 128, pages of 16, 512 own keys), each call warmed (compiled) first, then
profiled between cudaProfilerStart and Stop.
    usage (GPU machine): ncu --clock-control none --profile-from-start off --section ... \\
        python3 scripts/pending_gpu/cascade_ncu.py BATCH PREFIX"""

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
