"""Host time of attention_with_shared_prefix beside the flat paged call over the same pages
(bench.cascade_calls' inputs on the CPU: GQA 32/8, d = 128, pages of 16, a 4k prefix, 512 own
keys, B = 1), with stub_gpu.py standing in for the GPU, in three parts: the public call, the GPU
executor, and _launch.run alone. Each timed 25 times for 4,000 calls, the two calls alternated, the least kept.
    usage: PYTHONPATH=<tree> python host_cascade.py"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import stub_gpu  # noqa: E402,F401

from cupyflash import _cascade, _front, _kvcache, _launch, bench  # noqa: E402

pair = bench.cascade_calls(1, 4096, own=512, page_size=16, device="cpu")
cascade, flat = pair["cascade"], pair["flat_paged"]
calls, launches, real_route, real_run = {}, {}, _front.route, _launch.run
_front.route = lambda op, call, want: calls.setdefault(op.name, call) and real_route(op, call, want)
cascade(), flat()
_front.route = real_route
executors = {
    "cascade": lambda: _cascade.gpu_shared_prefix(stub_gpu.LIB, 0, calls["attention_with_shared_prefix"], False),
    "flat": lambda: _kvcache.gpu_with_kvcache(stub_gpu.LIB, 0, calls["attention_with_kvcache"], False),
}
for name, executor in executors.items():  # each executor's Launch and arrays, as it hands them on
    _launch.run = lambda launch, lib, device, arrays, want, given=_launch.EMPTY, name=name: (
        launches.setdefault(name, (launch, arrays)) and real_run(launch, lib, device, arrays, want, given)
    )
    executor()
_launch.run = real_run
parts = {
    "public call": (cascade, flat),
    "GPU executor": (executors["cascade"], executors["flat"]),
    "_launch.run": tuple(
        (lambda launch=launch, arrays=arrays: real_run(launch, stub_gpu.LIB, 0, arrays, False))
        for launch, arrays in (launches["cascade"], launches["flat"])
    ),
}
best = {}
for _ in range(25):
    for part, pair in parts.items():
        for which, f in zip(("cascade", "flat"), pair, strict=True):
            start = time.perf_counter()
            for _ in range(4000):
                f()
            best[part, which] = min(best.get((part, which), 1e9), (time.perf_counter() - start) / 4000 * 1e6)
for part in parts:
    c, f = best[part, "cascade"], best[part, "flat"]
    print(f"{part:13s} cascade {c:6.2f} us  flat {f:6.2f} us  cascade - flat {c - f:+.2f} us")
