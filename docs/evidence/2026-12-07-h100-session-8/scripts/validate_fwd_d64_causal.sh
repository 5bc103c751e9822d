#!/usr/bin/env bash
# d = 64 causal forward past 2048 keys on three consumers in round robin, dynamic schedule
# (_dispatch.FA3_FWD_TILES; below 2048 keys FA3_SHORT_FWD_TILES keeps two): the forward's GPU tests
# with its new long-sequence cases (test_gpu_fa2.py's bounded tiles and many-tiles case,
# test_varlen.py's packed d = 64), the score-function and block-mask tests, then the d = 64 prefill
# table beside cuDNN on this tree and on OLD_TREE (untracked: git archive 290fa07 cupyflash
# kernels_cu | tar -x -C ab_old), one process each, and this tree's training table.
#   usage (GPU machine, tree root, $OUT set): docs/evidence/2026-12-07-h100-session-8/scripts/validate_fwd_d64_causal.sh [SECONDS] [OLD_TREE]
#   carry: .whl
set -uo pipefail
END=${1:-480} OLD=${2:-ab_old}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
PYTHONPATH=$PWD:/tmp/site timeout -s INT $(( $(left) - 130 )) python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_fa2.py tests/test_varlen.py tests/test_gpu_mods.py tests/test_gpu_block_mask.py \
  tests/test_gpu_sinks.py tests/test_alibi.py tests/test_gpu_batch_invariant.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -15
for tree in . "$OLD"; do
  [ -d "$tree/cupyflash" ] && [ "$(left)" -gt 30 ] || continue
  name=$([ "$tree" = . ] && echo new || echo old)
  PYTHONPATH=$PWD/$tree:/tmp/site timeout 60 python3 -m cupyflash bench --head-dims 64 --dtype bfloat16 \
    --backends cupyflash cudnn --json $OUT/prefill_d64_$name.json > $OUT/prefill_d64_$name.log 2>&1
  echo "prefill d=64 ($name) rc=$? at ${SECONDS}s"; grep -E "^bfloat16" $OUT/prefill_d64_$name.log | cut -c1-200 | tail -6
done
[ "$(left)" -gt 30 ] && PYTHONPATH=$PWD:/tmp/site timeout $(( $(left) - 3 )) python3 -m cupyflash bench-train --head-dims 64 \
  --dtype bfloat16 --backends cupyflash cudnn --json $OUT/train_d64.json > $OUT/train_d64.log 2>&1
echo "train d=64 rc=$? at ${SECONDS}s"; grep -E "^bfloat16" $OUT/train_d64.log | cut -c1-200 | tail -6
