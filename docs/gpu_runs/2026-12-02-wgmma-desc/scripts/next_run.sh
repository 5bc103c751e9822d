#!/usr/bin/env bash
# Prepared for the next device call, not yet run: the d = 64 candidate next_softmax_after_pv_d64.diff
# (the softmax after its own P V, O's rescale and P's packing in the exponentials' stream)
# against main, forward A/B beside cuDNN under the three timings. Trees, made here first:
#   bash docs/gpu_runs/2026-12-02-wgmma-desc/scripts/make_ab_tree.sh cfbase HEAD
#   bash docs/gpu_runs/2026-12-02-wgmma-desc/scripts/make_ab_tree.sh cf_after_pv HEAD \
#     docs/gpu_runs/2026-12-02-wgmma-desc/scripts/next_softmax_after_pv_d64.diff
# then run with carry [".ab", ".whl"]. If the candidate wins at d = 64 under every timing, apply
# the diff to the working tree and run the Hopper GPU tests (run3.sh's list) before landing it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-wgmma-desc/scripts
timeout 300 python3 $S/ab3.py fwd .ab/cfbase .ab/cf_after_pv --json $OUT/after_pv_fwd_ab3.json > $OUT/after_pv_fwd_ab3.log 2>&1
echo "rc=$?" >> $OUT/after_pv_fwd_ab3.log; cut -c1-600 $OUT/after_pv_fwd_ab3.log
