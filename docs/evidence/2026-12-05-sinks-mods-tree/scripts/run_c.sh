#!/usr/bin/env bash
# A second, short call after run.sh: the chain-against-causal tree test as relaxed (outputs bit
# for bit, LSEs to float32 rounding), a training step at d = 64 beside cuDNN and PyTorch flash
# under the three timings (after 97ad395's host fix), and score functions beside FlexAttention
# at N = 4k with no fallback to its uncompiled path (forward, then forward + backward).
#   usage (GPU machine, tree root, $OUT set): run_c.sh [SECONDS]      (.whl/ carried)
set -uo pipefail
END=${1:-280}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache CUPYFLASH_GPU_MODS=1
nvidia-smi --query-gpu=name --format=csv,noheader
left() { echo $((END - SECONDS)); }
timeout 60 python3 -m pytest -q -n 8 -p no:cacheprovider -m gpu -rf tests/test_gpu_tree_mask.py -k chain \
  > $OUT/tests_chain.log 2>&1; echo "chain rc=$? at ${SECONDS}s" | tee -a $OUT/tests_chain.log
grep -E "^FAILED|passed|failed" $OUT/tests_chain.log | cut -c1-300
timeout $(( $(left) - 100 )) python3 -m cupyflash bench-train --dtype bfloat16 --head-dims 64 \
  --backends cupyflash cudnn flash --json $OUT/train.json > $OUT/train.log 2>&1
echo "train rc=$? at ${SECONDS}s" | tee -a $OUT/train.log; tail -12 $OUT/train.log | cut -c1-330
timeout $(left) python3 -m cupyflash bench-mods --head-dims 128 --functions causal softcap document_causal \
  --backward --json $OUT/mods.json > $OUT/mods.log 2>&1; echo "mods rc=$? at ${SECONDS}s" | tee -a $OUT/mods.log
grep -v "^ *warn\|Warning" $OUT/mods.log | tail -12 | cut -c1-300
