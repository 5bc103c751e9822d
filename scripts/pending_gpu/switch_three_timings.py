"""The Hopper backward with one _dispatch switch off and on, each beside cuDNN in its own
training rounds under all three timings of DESIGN.md (single, back_to_back, interleaved), so a
default flip rests on ratios that hold under each: per shape and setting, forward + backward and
the backward alone over cuDNN's, one line of JSON each.
    usage (GPU machine): python3 scripts/pending_gpu/switch_three_timings.py FLAG [SHAPE ...]
    SHAPE: d-N-causal (e.g. 128-4096-0); batch x heads as tune.py's (16k tokens, 2048 // d heads)"""

import json
import sys

from cupyflash import _dispatch, _plan, bench

flag, shapes = sys.argv[1], sys.argv[2:] or ["128-4096-0", "128-16384-0", "64-4096-1", "128-4096-1"]
default = getattr(_dispatch, flag)
for text in shapes:
    d, n, causal = (int(x) for x in text.split("-"))
    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, bool(causal), "bfloat16")
    for on in (False, True):
        setattr(_dispatch, flag, on)
        _plan.clear_caches()
        row = bench.run_training(shape, backends=("cupyflash", "cudnn"), timings=bench.TIMINGS)
        parts = (("step", ""), ("bwd", "_bwd"))  # forward + backward; the backward alone
        ratios = {
            timing: {part: round(t[f"cupyflash{key}"] / t[f"cudnn{key}"], 3) for part, key in parts}
            for timing, t in row["timings"].items()
        }
        result = {flag: on, "shape": text, "cupyflash_bwd": row.get("cupyflash_bwd"), "over_cudnn": ratios}
        print(json.dumps(result), flush=True)
setattr(_dispatch, flag, default)
