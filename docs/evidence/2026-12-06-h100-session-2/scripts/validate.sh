#!/usr/bin/env bash
# The first call of a session (any machine, no FlashAttention-4): what main runs on a GPU that no
# GPU has run yet (docs/evidence/2026-12-06-h100-session/). The score functions' code generator
# was rewritten (64c9474: what depends on b and h alone computed once per tile by a head
# function into UserMods' state, integers in 32 bits where they fit, tanh / exp / log as the
# kernels' own); an int length given twice in a row stays in the Launch's template (b8480de: the
# cascade's prefix length, a decode call's int cache_seqlens); a mask_mod alone with no block
# summary runs in the Hopper backward's new hook (c804dd1). So: the GPU tests of score
# functions, block masks, the cascade and decode, compute-sanitizer over the score-function
# variants, then the forward and forward + backward of score functions beside FlexAttention and
# the built-in options (bench-mods), and the cascade beside the flat paged call (bench-cascade).
#   usage (GPU machine, tree root, $OUT set): docs/evidence/2026-12-06-h100-session-2/scripts/validate.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
# -s INT: pytest still prints its summary (the failures named) when the limit stops it
run_tests() {  # LOG LIMIT WORKERS FILES...
  local log=$1 limit=$2 workers=$3; shift 3
  timeout -s INT "$limit" python3 -m pytest -q -n "$workers" -p no:cacheprovider -p no:benchmark -m gpu -rf \
    --tb=short -W ignore "$@" > "$OUT/$log" 2>&1
  echo "$log rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/$log" | cut -c1-300 | tail -20
}
run_tests tests.log 240 15 tests/test_gpu_mods.py tests/test_gpu_block_mask.py tests/test_mods_traced.py \
  tests/test_gpu_cascade.py tests/test_gpu_decode.py
timeout 200 python3 scripts/sanitize.py --out /tmp/sanitize_variant --only variant --tools memcheck,racecheck \
  --timeout 80 > $OUT/sanitize_variant.log 2>&1; echo "sanitize rc=$? at ${SECONDS}s"; tail -3 $OUT/sanitize_variant.log
timeout 40 python3 -m cupyflash bench-cascade --json $OUT/cascade.json > $OUT/cascade.log 2>&1
echo "cascade rc=$? at ${SECONDS}s"; tail -9 $OUT/cascade.log | cut -c1-300
[ "$(left)" -gt 30 ] && timeout $(( $(left) - 5 )) python3 -m cupyflash bench-mods --head-dims 128 --backward \
  --functions softcap alibi causal document_causal document --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -18 | cut -c1-300
