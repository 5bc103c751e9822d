#!/usr/bin/env bash
# The eager autograd route (_torch_ops._Eager) on the GPU, in one call: the torch-facing GPU tests,
# where a lone training step's time goes (scripts/step_timeline.py, host time per call), and a
# training step beside cuDNN and the tree before the change (PRE, made by make_ab_tree.sh from
# docs/gpu_runs/2026-12-02-wgmma-desc/scripts of 8f608e0) under the three timings (ab3.py).
#   usage (GPU machine, tree root, $OUT set): run.sh PRE AB3 [SECONDS]
set -uo pipefail
PRE=$1 AB3=$2 END=${3:-400}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/env.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_torch_ops.py tests/test_flash_attn.py \
  tests/test_flash_attn_lowlevel.py tests/test_flash_attn_bounds.py tests/test_ring_flash_attn.py > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
timeout 90 python3 scripts/step_timeline.py --d 64 --n 1024 > $OUT/timeline.log 2>&1
grep -E "^(cupyflash|cudnn)" $OUT/timeline.log | cut -c1-200
timeout $((END - SECONDS)) python3 $AB3 train $PRE --shapes 64-1024-0 64-1024-1 128-1024-0 128-1024-1 64-4096-0 \
  128-16384-0 --json $OUT/ab_train.json > $OUT/ab_train.log 2>&1; echo "ab rc=$? at ${SECONDS}s"
grep -v "^new:" $OUT/ab_train.log | sed -E 's/ \| err.*//' | cut -c1-420
