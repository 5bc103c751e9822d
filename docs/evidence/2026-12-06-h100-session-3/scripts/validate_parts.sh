#!/usr/bin/env bash
# A short first call (any machine, no FlashAttention-4) for what main runs on a GPU that no GPU
# has run yet, most needed first: score and mask functions by parts (5beb8f3: a row's and a
# key's reads once per fragment) and the hook written once for a score_mod alone (48bce2b), on
# top of the unvalidated commits that validate.sh covers. So: a new function's first-call build
# (NVRTC, no GPU), the GPU tests of score functions and block masks, the document masks'
# forward and forward + backward beside FlexAttention and the built-in causal path (bench-mods),
# then compute-sanitizer over the score-function variants with what time is left.
#   usage (GPU machine, tree root, $OUT set):
#     scripts/pending_gpu/validate_parts.sh [SECONDS [TEST_SECONDS [FUNCTION...]]]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-420}
TESTS=${2:-190}
shift $(( $# < 2 ? $# : 2 ))
FUNCTIONS=${*:-document_causal document causal}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.log
timeout 90 python3 -c "import sys; sys.path.insert(0, 'benchmarks_asv')
from benchmarks.compile import ScoreFunctionBuild as B
b = B(); b.setup('softcap'); [print(f, round(b.track_seconds(f), 2), 's', flush=True) for f in B.params]" \
  > $OUT/compile.log 2>&1; echo "compile rc=$? at ${SECONDS}s"; tail -6 $OUT/compile.log
timeout -s INT "$TESTS" python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_mods.py tests/test_gpu_block_mask.py tests/test_mods_traced.py \
  tests/test_gpu_decode.py::test_rotary_table_shorter_than_the_cache tests/test_gpu_decode.py::test_rotary_matches_the_host_twin \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -20
if [ "$(left)" -gt 100 ]; then
  timeout $(( $(left) - 70 )) python3 -m cupyflash bench-mods --head-dims 128 --backward \
    --functions $FUNCTIONS --json $OUT/mods.json > $OUT/mods.log 2>&1
  echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -22 | cut -c1-300
fi
[ "$(left)" -gt 30 ] && timeout $(( $(left) - 5 )) python3 scripts/sanitize.py --out /tmp/sanitize_variant --only variant \
  --tools memcheck --timeout 60 > $OUT/sanitize_variant.log 2>&1; echo "sanitize rc=$? at ${SECONDS}s"; tail -3 $OUT/sanitize_variant.log
