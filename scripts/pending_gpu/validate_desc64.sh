#!/usr/bin/env bash
# The Hopper kernels with their wgmma descriptors stepped by a 64-bit add (30d7bc7, hopper.cuh's
# wgmma_desc_advance: the same descriptor values, 46-57 fewer instructions a backward step) and
# the backward's -LSE read before the wait for S^T (and the producers' shared ring, the same
# SASS but for register names and order), not yet run on a GPU: first the GPU suites of every kernel that issues wgmma (the forward's in
# test_gpu_fa2.py, the backward's, the score functions', block masks', FP8 forward, the cascade's
# wgmma prefix), racecheck of the backward; then (time left) scripts/ab.py train of the tree
# before it (OLD_TREE) against this one, trees in rotating processes beside cuDNN. Predicted:
# the backward 0-4% faster, the forward 0-1%.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_desc64.sh [SECONDS] [OLD_TREE]
#   carry: .whl .ab   (OLD_TREE default .ab/4f04560: git archive 4f04560 cupyflash kernels_cu | tar x -C .ab/4f04560)
set -uo pipefail
END=${1:-560} OLD=${2:-.ab/4f04560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT $(( $(left) * 3 / 5 )) python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_fa2.py tests/test_gpu_backward.py tests/test_gpu_mods.py tests/test_gpu_block_mask.py \
  tests/test_gpu_fp8_forward.py tests/test_gpu_cascade.py -k "not torch_compile and not cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
[ "$(left)" -gt 80 ] && timeout 45 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py \
  > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? at ${SECONDS}s"; grep -E "SUMMARY|^(64|128) " $OUT/racecheck.log | head -4
[ -d "$OLD/cupyflash" ] && timeout $(( $(left) - 3 )) python3 scripts/ab.py train "$OLD" . --rounds 2 \
  --shapes bf16-128-4096-0 bf16-128-4096-1 bf16-128-16384-0 bf16-64-4096-0 bf16-64-16384-1 > $OUT/ab_train.log 2>&1
echo "ab train rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/ab_train.log | tail -8 | cut -c1-400
