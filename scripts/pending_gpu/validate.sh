#!/usr/bin/env bash
# The first call of a session (any machine, no FlashAttention-4): what main runs on a GPU that no
# GPU has run yet (docs/evidence/2026-12-06-h100-session-2/). A mask_mod alone keeps the kernels'
# own scale and runs no code on a BlockMask's plain tiles (bd38b41); the Hopper forward reads a
# tile's class before its waits (de816b3); a score_mod's backward runs on the Hopper kernel, its
# logits and derivative formed beside dS^T (772d394); the rotary kernels refuse
# a sequence whose positions pass a rotary table shorter than the cache (6154ffb). So: the GPU tests
# of score functions, block masks and rotary decoding, compute-sanitizer over the score-function
# variants, then the gallery's forward and forward + backward beside FlexAttention and the
# built-in options (bench-mods; the mask functions first).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate.sh [SECONDS]
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
# a new score function's first-call build (asv compile.ScoreFunctionBuild: trace, plan, NVRTC; no GPU)
timeout 90 python3 -c "import sys; sys.path.insert(0, 'benchmarks_asv')
from benchmarks.compile import ScoreFunctionBuild as B
b = B(); b.setup('softcap'); [print(f, round(b.track_seconds(f), 2), 's', flush=True) for f in B.params]" \
  > $OUT/compile.log 2>&1; echo "compile rc=$? at ${SECONDS}s"; cat $OUT/compile.log | tail -6
run_tests tests.log 240 15 tests/test_gpu_mods.py tests/test_gpu_block_mask.py tests/test_mods_traced.py \
  tests/test_gpu_decode.py::test_rotary_table_shorter_than_the_cache tests/test_gpu_decode.py::test_rotary_matches_the_host_twin
timeout 200 python3 scripts/sanitize.py --out /tmp/sanitize_variant --only variant --tools memcheck,racecheck \
  --timeout 80 > $OUT/sanitize_variant.log 2>&1; echo "sanitize rc=$? at ${SECONDS}s"; tail -3 $OUT/sanitize_variant.log
[ "$(left)" -gt 30 ] && timeout $(( $(left) - 5 )) python3 -m cupyflash bench-mods --head-dims 128 --backward \
  --functions causal sliding_window document_causal document softcap alibi --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -26 | cut -c1-300
