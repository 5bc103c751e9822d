#!/usr/bin/env bash
# The Hopper backward's two switches that are off until measured, in one call: each step's -LSE
# log2 e and D copied by the producer (_dispatch.FA3_BWD_ROWS_BY_PRODUCER; the 80-row step loop
# 567 -> 507 instructions offline, FA4's 463) and, with it, the decoupled consumers in d = 128's
# 80-row steps (FA3_BWD_DECOUPLED; 457 instructions, 231,720 bytes of shared memory). So: their
# GPU tests, the backward's suites (prep's padding rows are on the default path), racecheck on
# both variants, then tune.py hopper-bwd at d = 128 over 4k and 16k for each switch (the
# non-causal shapes: the 80-row steps both change). Predicted: rows_by_producer 1-4% at d = 128
# without a mask, 0-2% elsewhere; decoupled_rows (the producer's rows on both sides) 2-6%.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_producer_and_decoupled.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 150 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py -k "producer or decoupled" > $OUT/tests_new.log 2>&1
echo "new tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_new.log | cut -c1-250 | tail -10
timeout -s INT 150 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py tests/test_varlen.py tests/test_gpu_sinks.py -k "not producer and not decoupled" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -10
run=0
for flags in "FA3_BWD_ROWS_BY_PRODUCER=1 causal=1" "FA3_BWD_LATE_EXP=0 FA3_BWD_ROWS_BY_PRODUCER=1 FA3_BWD_DECOUPLED=1 causal=0"; do
  run=$((run + 1))
  timeout 60 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py $flags > $OUT/racecheck$run.log 2>&1
  echo "racecheck $flags rc=$? at ${SECONDS}s"; grep -E "^(64|128) |SUMMARY" $OUT/racecheck$run.log
done
for switch in rows_by_producer decoupled_rows; do
  budget=$(( $(left) - 5 )); [ $switch = rows_by_producer ] && budget=$(( budget / 2 ))
  [ "$budget" -gt 40 ] && timeout $budget python3 scripts/tune.py hopper-bwd --switch $switch --head-dims 128 \
    --seqlens 4096 16384 --noncausal-only --json $OUT/tune_$switch.json > $OUT/tune_$switch.log 2>&1
  echo "tune $switch rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_$switch.log | tail -8 | cut -c1-300
done
