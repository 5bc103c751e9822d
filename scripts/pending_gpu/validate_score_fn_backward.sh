#!/usr/bin/env bash
# The GPU suites of the backward with score functions, block masks and attn_mask (the Hopper
# backward's variants that the producer's rows reach now they are on by default, which the
# backward suites of validate_rows_by_producer_default.sh did not cover), and the reliability
# suite's autograd.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_score_fn_backward.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-200}
source scripts/pending_gpu/gpu_env.sh
timeout -s INT $(( END - 10 )) python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_mods.py tests/test_gpu_block_mask.py tests/test_gpu_attn_mask.py tests/test_gpu_reliability.py \
  > $OUT/tests_score_fn.log 2>&1
echo "score-function / mask / reliability suites rc=$? at ${SECONDS}s"
grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_score_fn.log | cut -c1-250 | tail -10
