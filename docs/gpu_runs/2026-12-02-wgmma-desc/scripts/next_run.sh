#!/usr/bin/env bash
# Prepared for the next device call, not yet run: three d = 64 candidates against main, forward
# A/B beside cuDNN under the three timings, in one process:
#   cf_after_pv   next_softmax_after_pv_d64.diff: the softmax after its own P V, O's rescale and
#                 P's packing in the exponentials' stream
#   cf_exp2_fma   next_exp2_fma_d64.diff: one exponential in four on the FMA pipe (exp2_fma)
#   cf_both       next_after_pv_and_exp2_fma_d64.diff: the two together
# Trees, made here first (run in the repository root):
#   S=docs/gpu_runs/2026-12-02-wgmma-desc/scripts
#   bash $S/make_ab_tree.sh cfbase HEAD
#   bash $S/make_ab_tree.sh cf_after_pv HEAD $S/next_softmax_after_pv_d64.diff
#   bash $S/make_ab_tree.sh cf_exp2_fma HEAD $S/next_exp2_fma_d64.diff
#   bash $S/make_ab_tree.sh cf_both HEAD $S/next_after_pv_and_exp2_fma_d64.diff
# then run with carry [".ab", ".whl"] (.whl: the array-API wheels). A candidate lands only if it
# wins at d = 64 under every timing and the Hopper GPU tests (run3.sh's list) pass with it applied.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-wgmma-desc/scripts
timeout 420 python3 $S/ab3.py fwd .ab/cfbase .ab/cf_after_pv .ab/cf_exp2_fma .ab/cf_both \
  --shapes 64-1024-0 64-1024-1 64-4096-0 64-4096-1 64-16384-0 --json $OUT/d64_fwd_ab3.json > $OUT/d64_fwd_ab3.log 2>&1
echo "rc=$?" >> $OUT/d64_fwd_ab3.log; cut -c1-900 $OUT/d64_fwd_ab3.log
