#!/usr/bin/env bash
# The Hopper forward reads a document mask's key ids ahead of the scores (variants.cuh's
# PartsAhead, UserMods::kKeysAhead): the forward's score-function and block-mask GPU tests, then
# bench-mods' document masks at d = 64 (forward; FlexAttention beside, three timings). Before it
# (H100, 2026-12-07): 0.75-0.86x FlexAttention; Nsight Compute 1084 us against Flex's 806 at
# N = 4k, long-scoreboard stalls 1.2 per issued instruction.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_keys_ahead.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT $(( $(left) * 2 / 5 )) python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_block_mask.py tests/test_gpu_mods.py \
  -k "functions_match or varlen_functions or masks or block" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
timeout $(( $(left) - 3 )) python3 -m cupyflash bench-mods --head-dims 64 --functions document document_causal \
  --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/mods.log | cut -c1-300 | tail -8
