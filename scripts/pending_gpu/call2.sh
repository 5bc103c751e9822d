#!/usr/bin/env bash
# Call 2 of 3, right after call1.sh on the same machine: FlashAttention-4's second part, then a
# training step (forward + backward) beside cuDNN and FlashAttention-4 under the three timings,
# the one-launch cascade beside the flat paged call (bench-cascade: B in {1, 2, 8, 64}, 4k and
# 32k prefixes), and score functions with block masks beside FlexAttention (bench-mods).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/call2.sh [SECONDS]
#   carry: .peers/fa4x2 .peers/bin .peers/fa4w .whl   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh && source .peers/bin/fa4_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m cupyflash bench-train --dtype bfloat16 --backends cupyflash cudnn fa4 \
  --json $OUT/train.json > $OUT/train.log 2>&1
echo "train rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/train.log | tail -16 | cut -c1-330
timeout 120 python3 -m cupyflash bench-cascade --json $OUT/cascade.json \
  > $OUT/cascade.log 2>&1; echo "cascade rc=$? at ${SECONDS}s"; tail -14 $OUT/cascade.log | cut -c1-300
timeout $(( $(left) - 100 )) python3 -m cupyflash bench-mods --head-dims 128 --backward --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -14 | cut -c1-300
# Nsight Compute where the cascade loses (B = 1 and 2, 4k prefix): its kernel beside the flat one
for b in 1 2; do
  [ "$(left)" -gt 40 ] && timeout 60 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats python3 scripts/pending_gpu/ncu_cascade.py $b 4096 > $OUT/ncu_cascade_b$b.log 2>&1
  echo "ncu b=$b rc=$? at ${SECONDS}s"
done
