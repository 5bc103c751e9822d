#!/usr/bin/env bash
# GPU call 2 of 2, right after run1.sh on the same machine: FlashAttention-4's second part, then a
# training step (forward + backward) beside cuDNN and FlashAttention-4 under the three timings,
# and the score functions beside FlexAttention (the implied bounds of a mask, 4220aab).
#   usage (GPU machine, tree root, $OUT set): run2.sh [SECONDS]
#   carry: .peers/fa4x2 .peers/bin .peers/fa4w .whl
set -uo pipefail
END=${1:-420}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh && source .peers/bin/fa4_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout $(( $(left) - 110 )) python3 -m cupyflash bench-train --dtype bfloat16 --backends cupyflash cudnn fa4 \
  --json $OUT/train.json > $OUT/train.log 2>&1
echo "train rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/train.log | tail -16 | cut -c1-330
timeout $(left) python3 -m cupyflash bench-mods --head-dims 128 --functions causal sliding_window document_causal \
  --json $OUT/mods.json > $OUT/mods.log 2>&1; echo "mods rc=$? at ${SECONDS}s"
grep -v "^ *warn\|Warning" $OUT/mods.log | tail -12 | cut -c1-300
