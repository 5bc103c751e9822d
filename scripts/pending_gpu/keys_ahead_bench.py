"""bench-mods' document masks at d = 64 (forward, FlexAttention beside, three timings) with
_mods.READ_KEYS_AHEAD off and then on, in one process: each setting's rows, then the change of
each row's ratio over FlexAttention (the peer as the common yardstick).
    usage (GPU machine): python3 scripts/pending_gpu/keys_ahead_bench.py [JSON]"""

import json
import sys

from cupyflash import _attention, _mods, _plan, bench

rows = {}
for ahead in (False, True):
    _mods.READ_KEYS_AHEAD = ahead
    _attention._kernel_mods.clear()
    _plan.clear_caches()
    rows[ahead] = []
    for shape in bench.MODS_SHAPES:
        if shape.head_dim != 64:
            continue
        for name, functions in bench.mods_gallery(shape.seqlen, shape.heads).items():
            if name in ("document", "document_causal"):
                rows[ahead].append(bench.run_mods(shape, name, functions, backward=False))
                print(f"ahead={ahead}", bench.format_mods_table(rows[ahead][-1:]).splitlines()[-1], flush=True)
for off, on in zip(rows[False], rows[True], strict=True):
    keys = [t for t in bench.TIMINGS if f"over_flex_{t}" in on and f"over_flex_{t}" in off]
    change = {t: round(on[f"over_flex_{t}"] / off[f"over_flex_{t}"], 3) for t in keys}
    print(off["function"], off["seqlen"], "over flex, ahead / not:", change, flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"off": rows[False], "on": rows[True]}, f, indent=1)
