#!/usr/bin/env bash
# The Hopper forward reading a document mask's key ids ahead of the scores (_mods.READ_KEYS_AHEAD,
# variants.cuh's PartsAhead), off until this runs: its GPU test (output and LSE bit for bit those
# of the reads where they are used, and the float64 host path's) with the block-mask and
# score-function forward tests, then bench-mods' document masks at d = 64 with the switch off and
# on in one process (keys_ahead_bench.py). Before it (H100, 2026-12-07): 0.75-0.86x FlexAttention;
# Nsight Compute 1084 us against Flex's 806 at N = 4k, 1.2 long-scoreboard stalls per issue.
# Predicted: most of those stalls gone, the forward 10-25% faster at N = 4k, less at 16k.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_keys_ahead.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT $(( $(left) * 2 / 5 )) python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_block_mask.py tests/test_gpu_mods.py \
  -k "read_ahead or forward_with or functions_match or varlen_functions or masks" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
# memcheck over the new test (its reads of key ids past a sequence's end, as before it, checked or
# inside the call's index ranges)
[ "$(left)" -gt 150 ] && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  -p no:benchmark -m gpu -x tests/test_gpu_block_mask.py -k "read_ahead and float16" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? at ${SECONDS}s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | head -3
timeout $(( $(left) - 3 )) python3 scripts/pending_gpu/keys_ahead_bench.py $OUT/keys_ahead.json > $OUT/bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/bench.log | cut -c1-300 | tail -12
