#!/usr/bin/env bash
# GPU call 1 of 2 on one kept machine: stage FlashAttention-4's first part (../../../../.peers,
# ../shared/peers/README.md), then the drop-in's GPU evidence: ring-flash-attn's functions on
# virtual ranks (bf16 CUDA, a stream per rank), flash-attn's lower-level and bounds tests, the GPU
# cases written without a GPU last time, flash-attn's own test file against
# cupyflash.flash_attn (scripts/flash_attn_suite.sh, staged into .peers/fa2tests), and
# compute-sanitizer over the sinks / score-function / tree-mask variants.
#   usage (GPU machine, tree root, $OUT set): run1.sh [SECONDS]
#   carry: .peers/fa4x1 .peers/bin .peers/fa2tests .whl
set -uo pipefail
END=${1:-540}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.log
timeout 240 python3 -m pytest -q -n 12 -p no:cacheprovider -m gpu -rf tests/test_ring_flash_attn.py \
  tests/test_flash_attn_lowlevel.py tests/test_flash_attn_bounds.py \
  "tests/test_gpu_mods.py::test_masks_with_implied_bounds" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -15
timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rf tests/test_gpu_jax.py -k "sinks" \
  > $OUT/tests_jax.log 2>&1
echo "jax rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_jax.log | cut -c1-300 | tail -8
timeout $(( $(left) - 130 )) bash scripts/flash_attn_suite.sh run .peers/fa2tests -n 14 -v -rfE \
  > $OUT/fa2suite.log 2>&1; echo "fa2 suite rc=$? at ${SECONDS}s"
grep -cE " PASSED " .peers/fa2tests/pytest.log | sed 's/^/passed lines: /'
grep -E "^(FAILED|ERROR)|passed|failed" .peers/fa2tests/pytest.log | cut -c1-250 | tail -40
cp .peers/fa2tests/pytest.log $OUT/fa2suite_pytest.log
timeout $(left) python3 scripts/sanitize.py --out $OUT/sanitize --only variant --tools memcheck,racecheck \
  --timeout 60 > $OUT/sanitize.log 2>&1; echo "sanitize rc=$? at ${SECONDS}s"; tail -4 $OUT/sanitize.log
