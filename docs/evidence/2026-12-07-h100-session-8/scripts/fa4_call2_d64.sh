#!/usr/bin/env bash
# The call after validate_fwd_d64.sh on the same machine: FlashAttention-4's second part; the d = 64
# prefill table (cupyflash, cuDNN, FA4; the three timings) on the tree before the d = 64 forward
# change (OLD_TREE, untracked: git archive 290fa07 cupyflash kernels_cu | tar -x -C ab_old) and on
# this one, one process each (compare ratios within a process); the Hopper backward's GPU tests
# (dK issued after dQ at d = 128); the d = 128 training step at N = 4k (--quick) on both trees.
#   usage (GPU machine, tree root, $OUT set): docs/evidence/2026-12-07-h100-session-8/scripts/fa4_call2_d64.sh [SECONDS] [OLD_TREE]
#   carry: .whl .peers/fa4x2 .peers/fa4w .peers/bin
set -uo pipefail
END=${1:-580} OLD=${2:-ab_old}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh > $OUT/stage.log 2>&1; tail -1 $OUT/stage.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
source .peers/bin/fa4_env.sh || echo "no FlashAttention-4"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
BASE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
tree_name() { [ "$1" = . ] && echo new || echo old; }
for tree in . "$OLD"; do
  [ -d "$tree/cupyflash" ] && [ "$(left)" -gt 300 ] || continue
  name=$(tree_name "$tree")
  PYTHONPATH=$PWD/$tree:$BASE timeout 130 python3 -m cupyflash bench --head-dims 64 --backends cupyflash cudnn fa4 \
    --json $OUT/prefill_d64_$name.json > $OUT/prefill_d64_$name.log 2>&1
  echo "prefill d=64 ($name) rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/prefill_d64_$name.log | cut -c1-300 | tail -9
done
PYTHONPATH=$PWD:$BASE timeout -s INT 70 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_backward.py > $OUT/bwd_tests.log 2>&1
echo "backward tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/bwd_tests.log | cut -c1-250 | tail -12
for tree in . "$OLD"; do
  [ -d "$tree/cupyflash" ] && [ "$(left)" -gt 40 ] || continue
  name=$(tree_name "$tree")
  PYTHONPATH=$PWD/$tree:$BASE timeout $(( $(left) / 2 + 10 )) python3 -m cupyflash bench-train --quick --head-dims 128 \
    --backends cupyflash cudnn fa4 --json $OUT/train_d128_$name.json > $OUT/train_d128_$name.log 2>&1
  echo "train d=128 N=4k ($name) rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/train_d128_$name.log | cut -c1-300 | tail -8
done
