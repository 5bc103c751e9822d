#!/usr/bin/env bash
# The call after validate_fwd_d64.sh on the same machine: FlashAttention-4's second part, then the
# d = 64 prefill table (cupyflash, cuDNN, FA4; the three timings) on the tree before the d = 64
# change (OLD_TREE, untracked: git archive 290fa07 cupyflash kernels_cu | tar -x -C ab_old) and on
# this one, one process each (compare ratios within a process); then the d = 128 score-function
# schedule (scripts/tune.py mods: static vs dynamic, FlexAttention beside) with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/fa4_call2_d64.sh [SECONDS] [OLD_TREE]
#   carry: .whl .peers/fa4x2 .peers/fa4w .peers/bin
set -uo pipefail
END=${1:-580} OLD=${2:-ab_old}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh > $OUT/stage.log 2>&1; tail -1 $OUT/stage.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
source .peers/bin/fa4_env.sh || echo "no FlashAttention-4"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
BASE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
for tree in . "$OLD"; do
  [ -d "$tree/cupyflash" ] && [ "$(left)" -gt 120 ] || continue
  name=$([ "$tree" = . ] && echo new || echo old)
  PYTHONPATH=$PWD/$tree:$BASE timeout 170 python3 -m cupyflash bench --head-dims 64 --backends cupyflash cudnn fa4 \
    --json $OUT/prefill_d64_$name.json > $OUT/prefill_d64_$name.log 2>&1
  echo "prefill d=64 ($name) rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/prefill_d64_$name.log | cut -c1-300 | tail -12
done
[ "$(left)" -gt 60 ] && PYTHONPATH=$PWD:$BASE timeout $(( $(left) - 5 )) python3 scripts/tune.py mods --head-dims 128 \
  --seqlens 16384 4096 --functions document alibi --json $OUT/tune_mods.json > $OUT/tune_mods.log 2>&1
echo "tune mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_mods.log | cut -c1-300 | tail -10
