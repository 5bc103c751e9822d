"""A new score or mask function's first-call build, as asv's compile.ScoreFunctionBuild times it
(trace, plan, NVRTC's build of the Hopper forward for sm_90a; no GPU), for the tree given.
    usage: PYTHONPATH=<tree> CUPY_CACHE_DIR=$(mktemp -d) python score_function_build.py <tree>"""

import importlib
import sys

tree = sys.argv[1]
sys.path[:0] = [f"{tree}/benchmarks_asv", tree]
build = importlib.import_module("benchmarks.compile").ScoreFunctionBuild
bench = build()
bench.setup("softcap")
print(" ".join(f"{f}={bench.track_seconds(f):.2f}" for f in build.params), flush=True)
