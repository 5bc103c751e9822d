#!/usr/bin/env bash
# The decoupled consumers (one meeting a step, each consumer's dQ part handed to the writer warp)
# in d = 128's 80-row steps, which fit an H100 block only beside the producer's rows (one copy of
# -LSE / D: 231,720 bytes of 232,448): FA3's and FA4's arrangement of the non-causal d = 128
# backward. Offline (sm_90a): the step loop 457 instructions (FA4's 463; 507 not decoupled), 8
# bytes of two loop-invariant values in local memory (2 LDL a step). Run after
# validate_bwd_rows_by_producer.sh (the rows' own tests). So: its GPU tests, racecheck without a
# causal mask, then tune.py hopper-bwd --switch decoupled_rows at d = 128 (both settings with the
# producer's rows). Predicted: the non-causal d = 128 backward 2-6% faster (one barrier a step
# less, the consumers' exponentials under each other's GEMMs; at 64-row steps the decoupling
# measured no change: there the operand reads bounded the step).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_decoupled_rows.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 150 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py -k "decoupled" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -10
timeout 60 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py FA3_BWD_LATE_EXP=0 \
  FA3_BWD_ROWS_BY_PRODUCER=1 FA3_BWD_DECOUPLED=1 causal=0 > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? at ${SECONDS}s"; grep -E "^(64|128) |SUMMARY" $OUT/racecheck.log
timeout $(( $(left) - 5 )) python3 scripts/tune.py hopper-bwd --switch decoupled_rows --head-dims 128 \
  --seqlens 1024 4096 16384 --noncausal-only --json $OUT/tune_decoupled_rows.json > $OUT/tune_decoupled_rows.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_decoupled_rows.log | tail -10 | cut -c1-300
