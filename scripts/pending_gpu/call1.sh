#!/usr/bin/env bash
# The GPU runs that code on main awaits, call 1 of 3 (calls 1 and 2 on one kept machine:
# FlashAttention-4 is staged in two parts, ../shared/peers/README.md). Call 1: FlashAttention-4's
# first part; the mask-tile test validate.sh found failing (its unclassed twin captured 5 arrays,
# over the kernels' 4); compute-sanitizer over the score-function variants (mods-implied
# included; 90 s was too little for it in validate.sh); then a fixed 1-in-N sample of
# flash-attn's own test file against cupyflash.flash_attn (scripts/flash_attn_suite.sh --sample,
# staged into .peers/fa2tests) with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/call1.sh [SECONDS] [SAMPLE]
#   carry: .peers/fa4x1 .peers/bin .peers/fa2tests .whl   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-560} SAMPLE=${2:-50}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh; echo "fa4 part 1 at ${SECONDS}s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.log
timeout -s INT 150 python3 -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_block_mask.py -k classes_its_own_tiles > $OUT/tiles.log 2>&1
echo "tiles rc=$? at ${SECONDS}s"; grep -E "^FAILED|passed|failed" $OUT/tiles.log | cut -c1-300 | tail -8
timeout 200 python3 scripts/sanitize.py --out /tmp/sanitize_variant --only variant --tools memcheck,racecheck \
  --timeout 80 > $OUT/sanitize_variant.log 2>&1; echo "sanitize rc=$? at ${SECONDS}s"; tail -4 $OUT/sanitize_variant.log
timeout -s INT $(( $(left) - 10 )) bash scripts/flash_attn_suite.sh run .peers/fa2tests --sample "$SAMPLE" -n 14 -rfE \
  > $OUT/fa2suite.log 2>&1; echo "fa2 suite (1 in $SAMPLE) rc=$? at ${SECONDS}s"
grep -E "^(FAILED|ERROR)|passed|failed" .peers/fa2tests/pytest.log | cut -c1-250 | tail -40
cp .peers/fa2tests/pytest.log $OUT/fa2suite_pytest.log
