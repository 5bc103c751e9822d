#!/usr/bin/env bash
# The first call of a session (any machine, no FlashAttention-4): what main runs on a GPU that no
# GPU has run yet. A call with a mask_mod and no BlockMask now hands every kernel the summary the
# mask implies (_block_mask.implied; the Hopper forward's first tile skipping by it), and masks may
# be built from masks (mods.and_masks); so the GPU tests of block masks and score functions, under
# torch.compile and JAX too, then compute-sanitizer over the score-function variants, then the
# GPU tests of the kernels around them with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.log
# -s INT: pytest still prints its summary (the failures named) when the limit stops it
run_tests() {  # LOG LIMIT WORKERS FILES...
  local log=$1 limit=$2 workers=$3; shift 3
  timeout -s INT "$limit" python3 -m pytest -q -n "$workers" -p no:cacheprovider -p no:benchmark -m gpu -rf \
    --tb=short -W ignore "$@" > "$OUT/$log" 2>&1
  echo "$log rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/$log" | cut -c1-300 | tail -20
}
run_tests tests.log 300 14 tests/test_gpu_block_mask.py tests/test_gpu_mods.py tests/test_mods_traced.py \
  tests/test_gpu_routes_stubbed.py
run_tests tests_jax.log 90 3 tests/test_gpu_jax.py -k "score or learned or mods"
[ "$(left)" -gt 220 ] && timeout 200 python3 scripts/sanitize.py --out $OUT/sanitize_variant --only variant \
  --tools memcheck,racecheck --timeout 80 > $OUT/sanitize_variant.log 2>&1 && tail -3 $OUT/sanitize_variant.log
[ "$(left)" -gt 60 ] && run_tests tests_more.log $(( $(left) - 15 )) 14 tests/test_gpu_attn_mask.py \
  tests/test_gpu_cascade.py tests/test_gpu_fa2.py tests/test_gpu_backward.py
rm -rf $OUT/sanitize_variant  # (its per-tool files: the log above has the counts)
