#!/usr/bin/env bash
# A short call (any machine, no FlashAttention-4): a BlockMask in the Hopper kernels' score step,
# classed per consumer (plain tiles with score_mod alone, the mask_mod not evaluated), and in the
# Hopper backward (a mask_mod alone: query blocks bounded by the summary's row ranges, the mask on
# mixed tiles alone), which no GPU has run: their GPU tests, then the mask functions' forward and
# forward + backward beside FlexAttention and the built-in causal (bench-mods); then, with the
# time left, flash-attn's kvcache cases at 131072 keys on 4 workers (a 1-in-25 sample on 14
# workers failed from there on; scripts/flash_attn_suite.sh now writes each failure's error).
#   usage (GPU machine, tree root, $OUT set): docs/evidence/2026-12-06-h100-session-2/scripts/validate2.sh [SECONDS]
#   carry: .whl .peers/fa2tests   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-330}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 120 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_block_mask.py tests/test_gpu_mods.py::test_masks_with_implied_bounds \
  tests/test_gpu_mods.py::test_masks_built_from_masks tests/test_gpu_mods.py::test_backward_matches_the_host_path \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -20
timeout $(( $(left) - 75 )) python3 -m cupyflash bench-mods --head-dims 128 --backward \
  --functions causal document document_causal --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -14 | cut -c1-300
timeout -s INT $(( $(left) - 5 )) bash scripts/flash_attn_suite.sh run .peers/fa2tests --sample 400 -n 4 -rfE \
  -k "kvcache and 131072" > $OUT/fa2kv.log 2>&1; echo "fa2 kvcache 131072 rc=$? at ${SECONDS}s"
tail -3 .peers/fa2tests/pytest.log; cp .peers/fa2tests/failures.txt $OUT/ 2>/dev/null
[ -f $OUT/failures.txt ] && cut -d'|' -f2 $OUT/failures.txt | sort | uniq -c | sort -rn | head -5 | cut -c1-250
