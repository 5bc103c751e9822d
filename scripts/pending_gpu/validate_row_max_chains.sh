#!/usr/bin/env bash
# The online softmax's row max in 4 partial chains (softmax.cuh's update_max at 8+ key tiles:
# FA4's reduction; the same value in any order), in every forward with 64- or 128-key blocks.
# Offline (sm_90a): the Hopper forward's dependent FMNMX chain over a loop of two key blocks
# 37 -> 12 at d = 64 and 128, the same 148 FMNMX, registers and spills unchanged. So: the
# softmax verbs' GPU tests (16- and 128-key blocks), the forward's suites, then scripts/ab.py
# prefill against the tree before it (.ab/1e59e7b: git archive 1e59e7b cupyflash kernels_cu) and
# the tree with it alone (.ab/0006094), this tree adding the consumers' waits for K and V moved
# ahead of their ping-pong turn (FA4's order: the turn 128 -> 94 instructions at d = 128, 98 -> 50
# at d = 64 causal, offline; predicted 0-3% where the consumers take turns).
# Predicted: the forward 0-2% faster at d = 64 and 128 (the first exponential of a block issues
# ~12 FMNMX latencies earlier; at d = 64 the exponentials bound the step). With it, the built-in
# ALiBi's tile loop in floats (variants.cuh: its Hopper loop 2664 -> 2535 instructions, the
# Hopper backward's step 901 -> 828 at d = 64, 589 -> 552 at d = 128; bit for bit the same below
# 2^24 positions; tests/test_alibi.py's GPU tests): builtin_score_tiles.py under each tree, cuDNN in each
# round as the yardstick; predicted the ALiBi forward 3-8% faster, plain and softcap unchanged.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_row_max_chains.sh [SECONDS]
#   carry: .whl .ab/1e59e7b .ab/0006094
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 200 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_softmax_verbs.py tests/test_alibi.py tests/test_gpu_pipeline.py tests/test_gpu_fa2.py tests/test_varlen.py \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -10
timeout $(( $(left) - 100 )) python3 scripts/ab.py prefill .ab/1e59e7b .ab/0006094 . --rounds 3 \
  --shapes bf16-64-16384-0 bf16-128-16384-0 bf16-64-1024-1 bf16-128-1024-1 bf16-128-4096-1 > $OUT/ab.log 2>&1
echo "ab rc=$? at ${SECONDS}s"; tail -14 $OUT/ab.log | cut -c1-300
for tree in .ab/1e59e7b .; do
  [ "$(left)" -gt 60 ] && PYTHONPATH=$tree:/tmp/site timeout $(( $(left) - 5 )) python3 scripts/pending_gpu/builtin_score_tiles.py \
    --rounds 3 > $OUT/builtin_$(basename $tree).log 2>&1
  echo "builtin score tiles ($tree) rc=$? at ${SECONDS}s"; cut -c1-300 $OUT/builtin_$(basename $tree).log | tail -6
done
