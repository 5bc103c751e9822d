#!/usr/bin/env bash
# The d = 128 Hopper backward's 80-row steps (_dispatch.FA3_BWD_ROWS80, off until this runs): its
# GPU tests (float64 oracle, bit-identical dK / dV, float16 through the LSE, NaN), then the tests
# the call before could not run (rerun_failed.txt: out of memory beside a 61 GiB worker at -n 15),
# at -n 6; then (time left) tune.py hopper-bwd --switch rows80 beside cuDNN on d = 128's
# non-causal training shapes. Predicted: the non-causal d = 128 backward 3-8% faster.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_rows80.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
PYTEST="python3 -m pytest -q -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore"
timeout 90 $PYTEST -n 6 tests/test_gpu_backward.py -k "80_row" > $OUT/rows80_tests.log 2>&1
echo "rows80 tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/rows80_tests.log | cut -c1-250 | tail -6
timeout -s INT $(( $(left) * 11 / 20 )) xargs -d '\n' -a scripts/pending_gpu/rerun_failed.txt $PYTEST -n 6 \
  > $OUT/rerun.log 2>&1
echo "rerun rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/rerun.log | cut -c1-250 | tail -8
timeout $(( $(left) - 3 )) python3 scripts/tune.py hopper-bwd --switch rows80 --head-dims 128 --noncausal-only \
  --seqlens 1024 4096 16384 > $OUT/tune_rows80.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_rows80.log | tail -8 | cut -c1-400
