#!/usr/bin/env bash
# Issue 41: the one-launch cascade's prefix in one wave of CTAs (_dispatch.cascade_prefix_splits,
# after cascade_small.py's sweeps). The cascade GPU tests under the new split counts, then the
# issue's cascade benchmark (python -m cupyflash bench-cascade: B in {1, 2, 8, 64} over 4k and
# 32k prefixes, the flat paged call beside, three timings).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_cascade_one_wave.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-230}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 100 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_cascade.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
timeout $(( $(left) - 3 )) python3 -m cupyflash bench-cascade --json $OUT/cascade.json > $OUT/cascade.log 2>&1
echo "bench-cascade rc=$? at ${SECONDS}s"; grep "^B=" $OUT/cascade.log
