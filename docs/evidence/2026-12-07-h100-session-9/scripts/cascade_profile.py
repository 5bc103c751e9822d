"""Where the one-launch cascade's time goes at B = 64 over a 32k prefix (issue 41): the kernel
alone (CUDA events, back to back) with 512 and 16 own keys per request (the prefix's share), the
flat paged call beside it, and each decode tile the cascade can take (16 or 32 packed rows).
    usage (GPU machine): python3 docs/evidence/2026-12-07-h100-session-9/scripts/cascade_profile.py"""

import json

from event_timing import kernel_us

from cupyflash import _dispatch, _plan, bench

forget_plans = _plan.clear_caches


default = _dispatch.cascade_tiles
for rows in (32, 16):
    _dispatch.cascade_tiles = lambda d, r, rows=rows: tuple(t for t in default(d, r) if t.block_m == rows)
    forget_plans()
    for batch, prefix in ((64, 32768), (8, 32768), (64, 4096)):
        row = {"tile_rows": rows, "batch": batch, "prefix": prefix}
        for own in (512, 16):
            calls = bench.cascade_calls(batch, prefix, own=own, page_size=16)
            row[f"cascade_own{own}"] = kernel_us(calls["cascade"])
            row[f"flat_own{own}"] = kernel_us(calls["flat_paged"])
        print(json.dumps(row), flush=True)
_dispatch.cascade_tiles = default
forget_plans()
