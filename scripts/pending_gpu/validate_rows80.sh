#!/usr/bin/env bash
# The d = 128 Hopper backward's 80-row steps (_dispatch.FA3_BWD_ROWS80, off until this runs) and
# the backward's regression against 4f04560, in priority order, each stage capped (a short lease
# still returns the first ones):
#   1. the 80-row steps' GPU tests (float64 oracle, bit-identical dK / dV, float16 through the LSE, NaN);
#   2. tune.py hopper-bwd --switch rows80 beside cuDNN on d = 128's non-causal training shapes
#      (predicted: the non-causal d = 128 backward 3-8% faster);
#   3. scripts/ab.py train of 4f04560, 30d7bc7 (64-bit descriptor steps), 4c4001b (+ -LSE ahead)
#      and this tree (+ the shared ring): the call before measured this tree's backward 1-4.5%
#      below 4f04560's over cuDNN (2 rounds);
#   4. the tests the call before could not run (out of memory beside a 61 GiB worker at -n 15:
#      its 195 node ids, listed in rerun_failed.txt beside this script on that run), at -n 6.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_rows80.sh
#   carry: .whl .ab   (.ab/C: git archive C cupyflash kernels_cu | tar x -C .ab/C, C = 4f04560 30d7bc7 4c4001b)
set -uo pipefail
source scripts/pending_gpu/gpu_env.sh
PYTEST="python3 -m pytest -q -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore"
timeout 75 $PYTEST -n 4 tests/test_gpu_backward.py -k "80_row" > $OUT/rows80_tests.log 2>&1
echo "rows80 tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/rows80_tests.log | cut -c1-250 | tail -6
timeout 170 python3 scripts/tune.py hopper-bwd --switch rows80 --head-dims 128 --noncausal-only \
  --seqlens 1024 4096 16384 > $OUT/tune_rows80.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_rows80.log | tail -8 | cut -c1-400
timeout 120 python3 scripts/ab.py train .ab/4f04560 .ab/30d7bc7 .ab/4c4001b . --rounds 2 \
  --shapes bf16-64-16384-1 bf16-128-16384-0 bf16-128-4096-0 > $OUT/ab_bisect.log 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -A6 "^medians" $OUT/ab_bisect.log | cut -c1-400
timeout 200 xargs -d '\n' -a scripts/pending_gpu/rerun_failed.txt $PYTEST -n 6 > $OUT/rerun.log 2>&1
echo "rerun rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/rerun.log | cut -c1-250 | tail -8
