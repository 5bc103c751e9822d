#!/usr/bin/env bash
# The GPU runs that code on main awaits, call 1 of 3 (calls 1 and 2 on one kept machine:
# FlashAttention-4 is staged in two parts, ../shared/peers/README.md). Call 1: FlashAttention-4's
# first part, then a fixed 1-in-N sample of flash-attn's own test file against
# cupyflash.flash_attn (scripts/flash_attn_suite.sh --sample, taken as pytest parametrizes;
# staged into .peers/fa2tests) with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/call1.sh [SECONDS] [SAMPLE]
#   carry: .peers/fa4x1 .peers/bin .peers/fa2tests .whl   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-560} SAMPLE=${2:-25}
left() { echo $((END - SECONDS)); }
bash .peers/bin/fa4_stage.sh; echo "fa4 part 1 at ${SECONDS}s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
# (130 s kept for the out-of-memory reruns below: 258 cases took 82 s on 4 workers, 30 then 42 s alone)
timeout -s INT $(( $(left) - 130 )) bash scripts/flash_attn_suite.sh run .peers/fa2tests --sample "$SAMPLE" -n 14 -rfE \
  > $OUT/fa2suite.log 2>&1; echo "fa2 suite (1 in $SAMPLE) rc=$? at ${SECONDS}s"
grep -E "^(FAILED|ERROR)|passed|failed" .peers/fa2tests/pytest.log | cut -c1-250 | tail -40
cp .peers/fa2tests/pytest.log $OUT/fa2suite_pytest.log
# the out-of-memory cases (14 workers share the GPU) again on 4 workers, then alone
[ "$(left)" -gt 40 ] && timeout -s INT $(( $(left) - 10 )) bash scripts/flash_attn_suite.sh rerun-oom .peers/fa2tests 4 0
cp .peers/fa2tests/failures*.txt $OUT/ 2>/dev/null; echo "failing after the reruns: $(wc -l < .peers/fa2tests/failures.txt)"
