#!/usr/bin/env bash
# Score functions after the code generator's rewrite (7ea87ca: what depends on b and h alone
# computed once per tile, integers in 32 bits where they fit, tanh / exp / log as the kernels'
# own): their GPU tests against the float64 host path, then the forward beside FlexAttention and
# the built-in options (bench-mods: its rows also give the largest difference from Flex).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/mods_check.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-170}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 95 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_mods.py -k "functions_match or index_outside or backward_matches or implied or built_from or cupy" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -12
timeout $(( $(left) - 3 )) python3 -m cupyflash bench-mods --head-dims 128 --functions softcap alibi causal \
  document_causal --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -10 | cut -c1-300
