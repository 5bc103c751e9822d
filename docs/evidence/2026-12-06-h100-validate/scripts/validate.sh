#!/usr/bin/env bash
# One call (any machine, no FlashAttention-4) for when device time is short: the packed launch
# template on every kind of launch (tests/test_gpu_launch_template.py: it is on every default
# path, checked byte for byte on the CPU only), then what removing the two opt-in switches needs:
# the GPU tests of the one-launch cascade and block masks (their tests set the switches
# themselves), the kernels they touched (score functions, the dense attn_mask summary, the decode
# kernel and its tree variant), score functions under torch.compile and jax.jit (a learned bias
# table's gradient on the GPU, eager and under jax.grad), ring-flash-attn on virtual ranks, the
# flash-attn lower-level functions; then the one-launch cascade beside the flat paged call
# (bench-cascade), compute-sanitizer over the shared-prefix and variant cases, and flash-attn's
# test file (.peers/fa2tests) with the time left.
#   usage (GPU machine, tree root, $OUT set): bash validate.sh [SECONDS]   (scripts/pending_gpu/validate.sh at 729fb83: call 1 of docs/evidence/2026-12-06-h100-validate)
#   carry: .whl .peers/fa2tests   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
upto() { local n=$(( $(left) - $2 )); [ "$n" -lt 1 ] && n=1; [ "$n" -lt "$1" ] && echo "$n" || echo "$1"; }  # $1 s, or less to keep $2 s
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.log
timeout $(upto 250 120) python3 -m pytest -q -n 14 -p no:cacheprovider -m gpu -rf --durations=15 tests/test_gpu_launch_template.py tests/test_gpu_cascade.py \
  tests/test_gpu_block_mask.py tests/test_gpu_mods.py tests/test_gpu_attn_mask.py tests/test_mods_traced.py \
  tests/test_gpu_tree_mask.py tests/test_gpu_decode.py tests/test_ring_flash_attn.py \
  tests/test_flash_attn_lowlevel.py tests/test_flash_attn_bounds.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -25
timeout $(upto 90 60) python3 -m pytest -q -n 2 -p no:cacheprovider -m gpu -rf tests/test_gpu_jax.py -k "score or learned or sinks" \
  > $OUT/tests_jax.log 2>&1; echo "jax rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_jax.log | tail -6
CUPYFLASH_CASCADE_ONE_LAUNCH=1 timeout $(upto 100 10) python3 -m cupyflash bench-cascade --json $OUT/cascade.json \
  > $OUT/cascade.log 2>&1; echo "cascade rc=$? at ${SECONDS}s"; tail -16 $OUT/cascade.log | cut -c1-300
for only in "shared prefix" variant; do
  [ "$(left)" -gt 90 ] || break
  tag=${only// /_}
  CUPYFLASH_CASCADE_ONE_LAUNCH=1 CUPYFLASH_GPU_BLOCK_MASK=1 timeout 80 python3 scripts/sanitize.py \
    --out $OUT/sanitize_$tag --only "$only" --tools memcheck,racecheck --timeout 35 > $OUT/sanitize_$tag.log 2>&1
  echo "sanitize $only rc=$? at ${SECONDS}s"; tail -3 $OUT/sanitize_$tag.log
done
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) bash scripts/flash_attn_suite.sh run .peers/fa2tests -n 14 -rfE --maxfail=50 \
    > $OUT/fa2suite.log 2>&1; echo "fa2 suite rc=$? at ${SECONDS}s"
  tail -5 .peers/fa2tests/pytest.log | cut -c1-250; cp .peers/fa2tests/pytest.log $OUT/fa2suite_pytest.log
fi
