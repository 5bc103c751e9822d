"""The cascade's prefix by wgmma against the mma.sync tiles (issue 41): the kernel alone (CUDA
events, back to back, the best of 5 rounds of 50 calls) with the wgmma prefix on and off
(_dispatch.CASCADE_WGMMA_MIN_ROWS), beside the flat paged call, at B in {2, 8, 16, 32, 64} over
4k and 32k prefixes (GQA 32/8, d = 128, pages of 16, 512 own keys, bf16), and their outputs'
largest difference from each other.
    usage (GPU machine): python3 docs/evidence/2026-12-07-h100-session-9/scripts/cascade_wgmma.py"""

import json

from event_timing import kernel_us

from cupyflash import _dispatch, _plan, bench

default = _dispatch.CASCADE_WGMMA_MIN_ROWS
_dispatch.CASCADE_WGMMA_PREFIX = True  # (off by default until this run)
for prefix in (32768, 4096):
    for batch in (2, 8, 16, 32, 64):
        calls = bench.cascade_calls(batch, prefix, own=512, page_size=16)
        row = {"batch": batch, "prefix": prefix, "flat": kernel_us(calls["flat_paged"])}
        outs = {}
        for name, min_rows in (("mma_sync", 1 << 30), ("wgmma_from32", 32)):
            _dispatch.CASCADE_WGMMA_MIN_ROWS = min_rows
            _plan.clear_caches()
            row[name] = kernel_us(calls["cascade"])
            outs[name] = calls["cascade"]().float()
        row["max_diff"] = round(float((outs["mma_sync"] - outs["wgmma_from32"]).abs().max()), 5)
        row["max_diff_flat"] = round(float((outs["wgmma_from32"] - calls["flat_paged"]().float()).abs().max()), 5)
        print(json.dumps(row), flush=True)
_dispatch.CASCADE_WGMMA_MIN_ROWS = default
_plan.clear_caches()
