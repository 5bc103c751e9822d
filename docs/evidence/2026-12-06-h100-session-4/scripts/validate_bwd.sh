#!/usr/bin/env bash
# The Hopper backward with a score_mod after 11f9a53 (every part of its dV / dK pass run; 772d394
# ran one or two of 4-8 and left dQ's later rows unwritten) and the reads a call's index ranges
# keep inside their arrays compiled unchecked (_mods.Grid; fdd909e) and an index difference that
# a float takes converted by parts (ALiBi's |q_idx - kv_idx|): the score-function GPU tests, then
# memcheck (and racecheck, given 200 s) over the score-function variants, then with what time is
# left ALiBi's and softcap's forward and forward + backward beside FlexAttention and the built-in
# options (d = 64 first: ALiBi's forward was 0.69-0.74x FlexAttention there).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd.sh [SECONDS [TEST_SECONDS]]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-480}
TESTS=${2:-240}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT "$TESTS" python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_mods.py tests/test_gpu_block_mask.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR| passed| failed" $OUT/tests.log | cut -c1-250 | tail -12
grep -c " PASSED " $OUT/tests.log
TOOLS=memcheck; [ "$(left)" -gt 320 ] && TOOLS=memcheck,racecheck
[ "$(left)" -gt 60 ] && timeout $(( $(left) > 200 ? 200 : $(left) - 10 )) python3 scripts/sanitize.py --out /tmp/sanitize_variant \
  --only variant --tools $TOOLS --timeout 90 > $OUT/sanitize.log 2>&1
echo "sanitize rc=$? at ${SECONDS}s"; tail -6 $OUT/sanitize.log | cut -c1-250
if [ "$(left)" -gt 80 ]; then
  timeout $(( $(left) - 10 )) python3 -m cupyflash bench-mods --head-dims 64 128 --backward \
    --functions alibi softcap --json $OUT/mods.json > $OUT/mods.log 2>&1
  echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -9 | cut -c1-250
fi
