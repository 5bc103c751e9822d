#!/usr/bin/env bash
# The Hopper backward with each step's -LSE log2 e and D copied by its producer into the ring
# with Q and dO, one copy for both consumers (_dispatch.FA3_BWD_ROWS_BY_PRODUCER, fa3_bwd.cu's
# Rows_by_producer; issue 43: the 80-row step loop 567 instructions against FA4's 463, 507 with
# it, offline). Prep now writes a padding row's -inf and 0 (read whole by the copies), on every
# Hopper layout: the default backward's tests too. So: the backward's GPU tests (the new
# variant's over every case, packed too) and the packed ones, racecheck on the new variant with
# and without a causal mask, then tune.py hopper-bwd --switch rows_by_producer beside cuDNN (and
# FA4 where staged). Predicted: the backward 1-4% faster at d = 128 without a mask (the 80-row
# steps: 60 of 567 instructions a step gone, a barrier's wait for the consumers' stores), 0-2%
# elsewhere.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_rows_by_producer.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 120 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py -k producer > $OUT/tests_new.log 2>&1
echo "new tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_new.log | cut -c1-250 | tail -10
timeout -s INT 200 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py tests/test_varlen.py tests/test_gpu_sinks.py -k "not producer" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -10
for causal in 1 0; do
  timeout 60 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py FA3_BWD_ROWS_BY_PRODUCER=1 \
    causal=$causal > $OUT/racecheck_causal$causal.log 2>&1
  echo "racecheck causal=$causal rc=$? at ${SECONDS}s"; grep -E "^(64|128) |SUMMARY" $OUT/racecheck_causal$causal.log
done
timeout $(( $(left) - 5 )) python3 scripts/tune.py hopper-bwd --switch rows_by_producer --head-dims 128 64 \
  --seqlens 4096 16384 --json $OUT/tune_rowp.json > $OUT/tune_rowp.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_rowp.log | tail -14 | cut -c1-300
