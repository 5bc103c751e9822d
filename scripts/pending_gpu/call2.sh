#!/usr/bin/env bash
# Call 2 of 3, right after call1.sh on the same machine: FlashAttention-4's second part, then a
# training step (forward + backward) beside cuDNN and FlashAttention-4 under the three timings
# (issue 43's table), then the forward alone beside them (bench: the prefill shapes).
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
timeout $(( $(left) - 5 )) python3 -m cupyflash bench --dtype bfloat16 --backends cupyflash cudnn fa4 \
  --json $OUT/prefill.json > $OUT/prefill.log 2>&1
echo "prefill rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/prefill.log | tail -16 | cut -c1-330
