#!/usr/bin/env bash
# The GPU runs that code on main awaits, call 1 of 3 (calls 1 and 2 on one kept machine:
# FlashAttention-4 is staged in two parts, ../shared/peers/README.md). Call 1: FlashAttention-4's
# first part, then the GPU tests of what has not yet run on a GPU -- the one-launch cascade
# (CUPYFLASH_CASCADE_ONE_LAUNCH, set by its tests), block masks, score functions under
# torch.compile and JAX, ring-flash-attn on virtual ranks with bf16 CUDA tensors, the
# flash-attn lower-level functions -- and the kernels the block mask touched (the dense attn_mask
# summary, the mods forwards and backward), then flash-attn's own test file against
# cupyflash.flash_attn (scripts/flash_attn_suite.sh, staged into .peers/fa2tests) with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/call1.sh [SECONDS]
#   carry: .peers/fa4x1 .peers/bin .peers/fa2tests .whl   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout 300 python3 -m pytest -q -n 14 -p no:cacheprovider -m gpu -rf tests/test_gpu_cascade.py \
  tests/test_gpu_block_mask.py tests/test_gpu_mods.py tests/test_gpu_attn_mask.py tests/test_mods_traced.py \
  tests/test_ring_flash_attn.py tests/test_flash_attn_lowlevel.py tests/test_flash_attn_bounds.py \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -25
timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rf tests/test_gpu_jax.py -k "sinks or mods or score" \
  > $OUT/tests_jax.log 2>&1
echo "jax rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_jax.log | cut -c1-300 | tail -8
timeout $(( $(left) - 10 )) bash scripts/flash_attn_suite.sh run .peers/fa2tests -n 14 -v -rfE \
  > $OUT/fa2suite.log 2>&1; echo "fa2 suite rc=$? at ${SECONDS}s"
grep -cE " PASSED " .peers/fa2tests/pytest.log | sed 's/^/passed lines: /'
grep -E "^(FAILED|ERROR)|passed|failed" .peers/fa2tests/pytest.log | cut -c1-250 | tail -40
cp .peers/fa2tests/pytest.log $OUT/fa2suite_pytest.log
